-- Character discovery (issue 20): categories to filter the list by, and
-- reviews. An account reviews a character once (a second review replaces
-- its first); `GET /characters` sorts by the reviews' counts and averages,
-- and `GET /characters/{slug}/reviews` pages through them, newest first.
-- `categories` is a JSON array of strings, as `tags` is.
ALTER TABLE characters ADD COLUMN categories TEXT NOT NULL DEFAULT '[]';

CREATE TABLE character_reviews (
    id TEXT PRIMARY KEY,
    slug TEXT NOT NULL,
    account_id TEXT NOT NULL,
    -- 1 to 5 stars.
    rating BIGINT NOT NULL,
    message TEXT,
    locale TEXT,
    -- The name the reviewer shows (the account's name when it is made).
    username TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    CHECK (rating BETWEEN 1 AND 5),
    UNIQUE (slug, account_id)
);

CREATE INDEX character_reviews_slug ON character_reviews (slug, created_at_ms);
