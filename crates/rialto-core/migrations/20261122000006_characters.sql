-- Characters created through the operator API (those of the configuration
-- are not stored). `tags` is a JSON array of strings; flags are 0 or 1
-- (portable between SQLite and PostgreSQL through sqlx's Any driver).
CREATE TABLE characters (
    slug TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    description TEXT NOT NULL,
    system_prompt TEXT NOT NULL,
    model_id TEXT,
    public BIGINT NOT NULL,
    tags TEXT NOT NULL,
    adult BIGINT NOT NULL,
    featured BIGINT NOT NULL,
    web_enabled BIGINT NOT NULL,
    author TEXT NOT NULL,
    photo_url TEXT NOT NULL,
    share_url TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);
