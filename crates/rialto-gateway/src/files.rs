//! `file` content parts, converted to text before the model sees them.
//!
//! A part `{"type": "file", "file": {"filename": "report.pdf", "file_data":
//! "data:application/pdf;base64,…"}}` (raw base64 also accepted) becomes a
//! text part holding the file's name and text. Formats, by extension or
//! media type: PDF (pdf-extract), DOCX and PPTX (their XML read with zip and
//! quick-xml), XLSX (calamine, one tab-separated line per row), and TXT, CSV
//! and Markdown (UTF-8). A part may instead give `file_url` (or `url`): the
//! gateway fetches it over HTTP(S), refusing addresses inside the
//! operator's network (loopback, private, link-local, ...) unless
//! `gateway.file_urls_allow_private`, pinning the address it checked (no
//! DNS rebinding), following no redirects, within 15 s and the size limit.
//! Limits: [`MAX_FILE_BYTES`] per file decoded and
//! [`MAX_TEXT_CHARS`] of text per file. Before any parser sees a file,
//! [`precheck`] refuses what would make one recurse or allocate without
//! bound (PDFs nested too deep, sheets spanning too many cells); then the
//! parsing itself runs in a bounded child process (`convert.rs`). A file
//! that cannot be read is a 400 naming its part, never a 500.

use std::io::{Cursor, Read};

use base64::Engine;
use serde_json::{Value, json};

/// The largest file accepted, decoded.
pub const MAX_FILE_BYTES: usize = 10 * 1024 * 1024;
/// The most `file` parts one request may carry.
pub const MAX_FILE_PARTS: usize = 10;
/// The most bytes the files of one request may hold together, inline and
/// fetched: what one request can make the gateway hold in memory.
pub const MAX_REQUEST_FILE_BYTES: usize = 20 * 1024 * 1024;
/// The most text one file may become.
pub const MAX_TEXT_CHARS: usize = 1_000_000;
/// The most entries of a DOCX, PPTX or XLSX archive read (zip bombs).
const MAX_ARCHIVE_BYTES: u64 = 64 * 1024 * 1024;

/// A file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Pdf,
    Docx,
    Pptx,
    Xlsx,
    Text,
    /// A web page: its readable part (Mozilla Readability's rules), as
    /// Markdown.
    Html,
}

/// Extensions read as UTF-8 text: prose, data and source code.
const TEXT_EXTENSIONS: &[&str] = &[
    "txt", "csv", "md", "markdown", "json", "jsonl", "xml", "yaml", "yml", "toml", "ini", "log",
    "sql", "py", "js", "mjs", "ts", "tsx", "jsx", "c", "h", "cc", "cpp", "hpp", "cs", "java", "kt",
    "go", "rs", "rb", "php", "swift", "scala", "sh", "bash", "ps1", "r", "lua", "pl", "css", "tex",
];

pub(crate) fn format_of(name: &str, media_type: &str) -> Option<Format> {
    let extension = name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase());
    match (extension.as_deref(), media_type) {
        (Some("pdf"), _) | (_, "application/pdf") => Some(Format::Pdf),
        (Some("docx"), _)
        | (_, "application/vnd.openxmlformats-officedocument.wordprocessingml.document") => {
            Some(Format::Docx)
        }
        (Some("pptx"), _)
        | (_, "application/vnd.openxmlformats-officedocument.presentationml.presentation") => {
            Some(Format::Pptx)
        }
        (Some("xlsx"), _)
        | (_, "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet") => {
            Some(Format::Xlsx)
        }
        (Some("html" | "htm" | "xhtml"), _) | (_, "text/html" | "application/xhtml+xml") => {
            Some(Format::Html)
        }
        (Some(extension), _) if TEXT_EXTENSIONS.contains(&extension) => Some(Format::Text),
        (_, "text/plain" | "text/csv" | "text/markdown" | "application/json") => Some(Format::Text),
        _ => None,
    }
}

/// The deepest nesting of arrays and dictionaries a PDF may have. Real
/// documents stay in single digits; lopdf's parser recurses once a level,
/// and a few thousand levels overflow its stack.
const MAX_PDF_NESTING: usize = 64;
/// The most cells a sheet's bounding box may span: calamine allocates
/// every cell between the first and the last, so two cells at A1 and
/// XFD1048576 would ask for ~550 GB.
const MAX_SHEET_CELLS: u64 = 4_000_000;

/// Bounded checks of a file's structure before any parser sees it: what
/// would make a parser recurse or allocate without bound is refused here,
/// in linear time and constant memory (the sandbox in `convert.rs` is the
/// second line, for what these checks cannot foresee).
pub(crate) fn precheck(name: &str, format: Format, bytes: &[u8]) -> Result<(), String> {
    match format {
        Format::Pdf => pdf_nesting(bytes).map_err(|why| format!("{name:?} {why}")),
        Format::Xlsx => sheet_extent(bytes)
            .map_err(|why| format!("{name:?} could not be read as an XLSX file: {why}")),
        Format::Html if bytes.len() > MAX_HTML_BYTES => Err(format!(
            "{name:?} is a page of more than {MAX_HTML_BYTES} bytes of HTML"
        )),
        Format::Docx | Format::Pptx | Format::Text | Format::Html => Ok(()),
    }
}

/// Refuses a PDF whose arrays and dictionaries nest deeper than
/// [`MAX_PDF_NESTING`], skipping what is not syntax: strings (`(...)`,
/// with escapes and balanced parentheses), comments, and the bytes of
/// streams (`stream` ... `endstream`), which may hold anything.
fn pdf_nesting(bytes: &[u8]) -> Result<(), String> {
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'(' => {
                // A literal string: nested parentheses balance, `\` escapes.
                let mut level = 1usize;
                i += 1;
                while i < bytes.len() && level > 0 {
                    match bytes[i] {
                        b'\\' => i += 1,
                        b'(' => level += 1,
                        b')' => level -= 1,
                        _ => {}
                    }
                    i += 1;
                }
                continue;
            }
            b'%' => {
                while i < bytes.len() && bytes[i] != b'\n' && bytes[i] != b'\r' {
                    i += 1;
                }
            }
            b'[' => depth += 1,
            b'<' if bytes.get(i + 1) == Some(&b'<') => {
                depth += 1;
                i += 1;
            }
            b']' => depth = depth.saturating_sub(1),
            b'>' if bytes.get(i + 1) == Some(&b'>') => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            // The keyword, after white space or a dictionary's end and
            // before an end of line (not a name such as /streamX).
            b's' if bytes[i..].starts_with(b"stream")
                && matches!(bytes.get(i + 6), Some(b'\r' | b'\n'))
                && (i == 0 || matches!(bytes[i - 1], b' ' | b'\t' | b'\r' | b'\n' | b'>')) =>
            {
                // Jump to the stream's end; an unterminated one ends the file.
                let body = i + b"stream".len();
                i = find(&bytes[body..], b"endstream").map_or(bytes.len(), |at| body + at + 9);
                continue;
            }
            _ => {}
        }
        if depth > MAX_PDF_NESTING {
            return Err(format!(
                "nests arrays or dictionaries more than {MAX_PDF_NESTING} deep"
            ));
        }
        i += 1;
    }
    Ok(())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// Refuses a workbook whose sheets' cells span more than
/// [`MAX_SHEET_CELLS`], reading each sheet's cell references (`r="B7"`)
/// as a stream of XML events (no sheet is held in memory whole).
fn sheet_extent(bytes: &[u8]) -> Result<(), String> {
    use quick_xml::events::Event;
    let mut archive = zip::ZipArchive::new(Cursor::new(bytes)).map_err(|e| e.to_string())?;
    let sheets: Vec<String> = archive
        .file_names()
        .filter(|n| n.starts_with("xl/worksheets/") && n.ends_with(".xml"))
        .map(str::to_owned)
        .collect();
    for sheet in sheets {
        let entry = archive
            .by_name(&sheet)
            .map_err(|e| e.to_string())?
            .take(MAX_ARCHIVE_BYTES);
        let mut reader = quick_xml::Reader::from_reader(std::io::BufReader::new(entry));
        let mut buffer = Vec::new();
        // (first row, last row, first column, last column), 1-based.
        let mut extent: Option<(u64, u64, u64, u64)> = None;
        loop {
            let event = reader
                .read_event_into(&mut buffer)
                .map_err(|e| e.to_string())?;
            match &event {
                Event::Start(element) | Event::Empty(element)
                    if element.local_name().as_ref() == b"c" =>
                {
                    let reference = element
                        .attributes()
                        .flatten()
                        .find(|a| a.key.local_name().as_ref() == b"r");
                    if let Some((row, column)) = reference.and_then(|a| cell_position(&a.value)) {
                        let (r0, r1, c0, c1) = extent.unwrap_or((row, row, column, column));
                        let grown = (r0.min(row), r1.max(row), c0.min(column), c1.max(column));
                        let cells = (grown.1 - grown.0 + 1).saturating_mul(grown.3 - grown.2 + 1);
                        if cells > MAX_SHEET_CELLS {
                            return Err(format!(
                                "a sheet spans {cells} cells, more than {MAX_SHEET_CELLS}"
                            ));
                        }
                        extent = Some(grown);
                    }
                }
                Event::Eof => break,
                _ => {}
            }
            buffer.clear();
        }
    }
    Ok(())
}

/// `B7` -> (row 7, column 2); None when it is not a cell reference.
fn cell_position(reference: &[u8]) -> Option<(u64, u64)> {
    let letters = reference
        .iter()
        .take_while(|b| b.is_ascii_alphabetic())
        .count();
    if letters == 0 || letters > 3 {
        return None;
    }
    let column = reference[..letters].iter().fold(0u64, |column, letter| {
        column * 26 + u64::from(letter.to_ascii_uppercase() - b'A' + 1)
    });
    let row: u64 = std::str::from_utf8(&reference[letters..])
        .ok()?
        .parse()
        .ok()?;
    (row >= 1).then_some((row, column))
}

/// Why a file of no format we read is refused.
pub(crate) fn unsupported(name: &str) -> String {
    format!(
        "{name:?} is not a supported file: send PDF, DOCX, PPTX, XLSX, HTML, or text \
         (TXT, CSV, MD, JSON, source code)"
    )
}

/// The text of a file, or why it cannot be read.
pub fn to_text(name: &str, media_type: &str, bytes: &[u8]) -> Result<String, String> {
    let format = format_of(name, media_type).ok_or_else(|| unsupported(name))?;
    let text = match format {
        Format::Text => {
            String::from_utf8(bytes.to_vec()).map_err(|_| format!("{name:?} is not UTF-8 text"))?
        }
        Format::Pdf => pdf_extract::extract_text_from_mem(bytes)
            .map_err(|_| format!("{name:?} could not be read as a PDF"))?,
        Format::Docx => office_text(bytes, |entry| entry == "word/document.xml", b"t", b"p")
            .map_err(|why| format!("{name:?} could not be read as a DOCX file: {why}"))?,
        Format::Pptx => office_text(
            bytes,
            |entry| entry.starts_with("ppt/slides/slide") && entry.ends_with(".xml"),
            b"t",
            b"p",
        )
        .map_err(|why| format!("{name:?} could not be read as a PPTX file: {why}"))?,
        Format::Xlsx => sheet_text(bytes)
            .map_err(|why| format!("{name:?} could not be read as an XLSX file: {why}"))?,
        Format::Html => page_text(bytes)
            .map_err(|why| format!("{name:?} could not be read as a web page: {why}"))?,
    };
    if text.chars().count() > MAX_TEXT_CHARS {
        return Err(format!(
            "{name:?} holds more than {MAX_TEXT_CHARS} characters of text"
        ));
    }
    Ok(text)
}

/// The most HTML a page may hold to be read (a DOM costs many times its
/// source); beyond, the page is refused before parsing.
pub(crate) const MAX_HTML_BYTES: usize = 4 * 1024 * 1024;

/// An article shorter than this (characters) is weighed against the
/// page's whole text.
const MIN_ARTICLE_CHARS: usize = 500;

/// The most elements a page's DOM may have.
const MAX_HTML_ELEMENTS: usize = 200_000;

/// The readable part of a web page as Markdown, its title first as a
/// `# ` heading (the scraper reads it back as the page's title). A page
/// Readability finds no article in (a list of links, an app shell) gives
/// its whole text.
fn page_text(bytes: &[u8]) -> Result<String, String> {
    let html = String::from_utf8_lossy(bytes);
    let config = dom_smoothie::Config {
        text_mode: dom_smoothie::TextMode::Formatted,
        max_elements_to_parse: MAX_HTML_ELEMENTS,
        ..Default::default()
    };
    let mut readability = dom_smoothie::Readability::new(html.as_ref(), None, Some(config))
        .map_err(|e| e.to_string())?;
    let whole_page = || {
        let document = dom_query::Document::from(html.as_ref());
        document
            .select("script, style, noscript, template")
            .remove();
        let title = document.select("title").text().trim().to_owned();
        (title, document.select("body").formatted_text().to_string())
    };
    let (title, text) = match readability.parse() {
        // Readability's best guess at a page that is mostly links (an
        // index, a reference list) can be a stray box of a few words: the
        // page's whole text says more.
        Ok(article) if article.text_content.trim().chars().count() < MIN_ARTICLE_CHARS => {
            let (title, page) = whole_page();
            if page.trim().len() > article.text_content.trim().len() {
                (title, page)
            } else {
                (article.title, article.text_content.to_string())
            }
        }
        Ok(article) => (article.title, article.text_content.to_string()),
        Err(dom_smoothie::ReadabilityError::GrabFailed) => whole_page(),
        Err(error) => return Err(error.to_string()),
    };
    let text = text.trim();
    let title = title.trim();
    Ok(
        if title.is_empty() || text.starts_with(&format!("# {title}")) {
            text.to_owned()
        } else {
            format!("# {title}\n\n{text}")
        },
    )
}

/// The text of the XML entries `wanted` of an Office archive: the content
/// of `text_tag` elements, a line break at each `paragraph_tag` end.
fn office_text(
    bytes: &[u8],
    wanted: impl Fn(&str) -> bool,
    text_tag: &[u8],
    paragraph_tag: &[u8],
) -> Result<String, String> {
    use quick_xml::events::Event;
    let mut archive = zip::ZipArchive::new(Cursor::new(bytes)).map_err(|e| e.to_string())?;
    let mut names: Vec<String> = archive
        .file_names()
        .filter(|n| wanted(n))
        .map(str::to_owned)
        .collect();
    if names.is_empty() {
        return Err("no document part inside".to_owned());
    }
    // slide2 before slide10.
    names.sort_by_key(|n| {
        let digits: String = n.chars().filter(char::is_ascii_digit).collect();
        (digits.parse::<u64>().unwrap_or(0), n.clone())
    });
    let mut text = String::new();
    // What all entries may expand to together, read as a stream: a deck of
    // many slides is bounded as a whole, not one slide at a time.
    let mut expansion = MAX_ARCHIVE_BYTES;
    for name in names {
        let mut entry = archive
            .by_name(&name)
            .map_err(|e| e.to_string())?
            .take(expansion);
        let mut reader = quick_xml::Reader::from_reader(std::io::BufReader::new(&mut entry));
        let mut buffer = Vec::new();
        let mut inside = false;
        loop {
            // Four bytes a character at most: past this, the text is over
            // its cap whatever it holds, so stop expanding.
            if text.len() > MAX_TEXT_CHARS * 4 {
                return Err(format!("more than {MAX_TEXT_CHARS} characters of text"));
            }
            match reader
                .read_event_into(&mut buffer)
                .map_err(|e| e.to_string())?
            {
                Event::Start(e) if e.local_name().as_ref() == text_tag => inside = true,
                Event::End(e) if e.local_name().as_ref() == text_tag => inside = false,
                Event::End(e) if e.local_name().as_ref() == paragraph_tag => text.push('\n'),
                Event::Text(t) if inside => {
                    text.push_str(&t.decode().map_err(|e| e.to_string())?);
                }
                Event::GeneralRef(r) if inside => {
                    let entity = r.decode().map_err(|e| e.to_string())?;
                    let resolved = match entity.as_ref() {
                        "amp" => Some('&'),
                        "lt" => Some('<'),
                        "gt" => Some('>'),
                        "quot" => Some('"'),
                        "apos" => Some('\''),
                        _ => r.resolve_char_ref().ok().flatten(),
                    };
                    if let Some(c) = resolved {
                        text.push(c);
                    }
                }
                Event::Eof => break,
                _ => {}
            }
            buffer.clear();
        }
        drop(reader);
        expansion = entry.limit();
        if expansion == 0 {
            return Err(format!(
                "its parts expand to more than {MAX_ARCHIVE_BYTES} bytes"
            ));
        }
    }
    Ok(text.trim_end().to_owned())
}

/// Every sheet of a workbook: its name, then one tab-separated line a row.
fn sheet_text(bytes: &[u8]) -> Result<String, String> {
    use calamine::Reader;
    let mut workbook: calamine::Xlsx<_> = calamine::open_workbook_from_rs(Cursor::new(bytes))
        .map_err(|e: calamine::XlsxError| e.to_string())?;
    let mut text = String::new();
    for name in workbook.sheet_names() {
        let range = workbook.worksheet_range(&name).map_err(|e| e.to_string())?;
        text.push_str(&format!("# {name}\n"));
        for row in range.rows() {
            let cells: Vec<String> = row.iter().map(ToString::to_string).collect();
            text.push_str(&cells.join("\t"));
            text.push('\n');
        }
    }
    Ok(text.trim_end().to_owned())
}

/// A `file` part's name, media type and bytes.
fn decode_part(file: &Value) -> Result<(String, String, Vec<u8>), String> {
    let name = file
        .get("filename")
        .and_then(Value::as_str)
        .unwrap_or("file")
        .to_owned();
    let data = file
        .get("file_data")
        .and_then(Value::as_str)
        .ok_or_else(|| "file_data (base64, or a data: URL) is required".to_owned())?;
    let (media_type, encoded) = match data.strip_prefix("data:") {
        Some(rest) => {
            let (header, payload) = rest
                .split_once(',')
                .ok_or_else(|| "the data: URL has no comma".to_owned())?;
            (header.trim_end_matches(";base64").to_owned(), payload)
        }
        None => (String::new(), data),
    };
    // Refuse before decoding what would be too large anyway.
    if encoded.len() / 4 * 3 > MAX_FILE_BYTES + 3 {
        return Err(format!("the file is larger than {MAX_FILE_BYTES} bytes"));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .map_err(|_| "file_data is not valid base64".to_owned())?;
    if bytes.len() > MAX_FILE_BYTES {
        return Err(format!("the file is larger than {MAX_FILE_BYTES} bytes"));
    }
    Ok((name, media_type, bytes))
}

/// Fetches the `file_url` parts' files into `file_data` (data: URLs), so
/// that [`convert`] finds every file inline; the location and reason of
/// the first that fails.
///
/// At most [`MAX_FILE_PARTS`] parts, holding [`MAX_REQUEST_FILE_BYTES`]
/// together: inline files count first, and each download stops at what
/// is left (the caps hold while bytes arrive, not after).
pub async fn fetch_urls(
    messages: &mut [Value],
    allow_private: bool,
) -> Result<(), (usize, usize, String)> {
    let mut budget = MAX_REQUEST_FILE_BYTES;
    let over_budget =
        || format!("the files of one request may hold {MAX_REQUEST_FILE_BYTES} bytes together");
    for (count, (m, p, part)) in file_parts(messages).enumerate() {
        if count >= MAX_FILE_PARTS {
            return Err((
                m,
                p,
                format!("a request may carry at most {MAX_FILE_PARTS} file parts"),
            ));
        }
        if let Some(Value::String(data)) = part["file"].get("file_data") {
            // Base64: three bytes for four characters.
            let decoded = data.len() / 4 * 3;
            budget = budget
                .checked_sub(decoded)
                .ok_or_else(|| (m, p, over_budget()))?;
        }
    }
    for (m, message) in messages.iter_mut().enumerate() {
        let Some(Value::Array(parts)) = message.get_mut("content") else {
            continue;
        };
        for (p, part) in parts.iter_mut().enumerate() {
            if part.get("type").and_then(Value::as_str) != Some("file") {
                continue;
            }
            let file = &mut part["file"];
            if file.get("file_data").is_some() {
                continue;
            }
            let Some(url) = file
                .get("file_url")
                .or_else(|| file.get("url"))
                .and_then(Value::as_str)
                .map(str::to_owned)
            else {
                continue;
            };
            let (media_type, bytes) = fetch(&url, allow_private, budget.min(MAX_FILE_BYTES))
                .await
                .map_err(|why| {
                    let why = if why == TOO_LARGE && budget < MAX_FILE_BYTES {
                        over_budget()
                    } else {
                        why
                    };
                    (m, p, why)
                })?;
            budget -= bytes.len();
            if file.get("filename").is_none() {
                let name = url
                    .split(['?', '#'])
                    .next()
                    .and_then(|u| u.rsplit('/').next())
                    .filter(|n| !n.is_empty())
                    .unwrap_or("file")
                    .to_owned();
                file["filename"] = json!(name);
            }
            let encoded = base64::engine::general_purpose::STANDARD.encode(bytes);
            file["file_data"] = json!(format!("data:{media_type};base64,{encoded}"));
        }
    }
    Ok(())
}

/// IPv4 ranges no file URL may reach: IANA's special-purpose registry
/// (those not globally reachable, and relays that would forward elsewhere),
/// as (network, prefix length).
const V4_NOT_PUBLIC: [([u8; 4], u8); 15] = [
    ([0, 0, 0, 0], 8),       // "this network", with the unspecified address
    ([10, 0, 0, 0], 8),      // private
    ([100, 64, 0, 0], 10),   // carrier-grade NAT
    ([127, 0, 0, 0], 8),     // loopback
    ([169, 254, 0, 0], 16),  // link local (cloud metadata)
    ([172, 16, 0, 0], 12),   // private
    ([192, 0, 0, 0], 24),    // IETF protocol assignments
    ([192, 0, 2, 0], 24),    // documentation
    ([192, 88, 99, 0], 24),  // 6to4 relay anycast
    ([192, 168, 0, 0], 16),  // private
    ([198, 18, 0, 0], 15),   // benchmarking
    ([198, 51, 100, 0], 24), // documentation
    ([203, 0, 113, 0], 24),  // documentation
    ([224, 0, 0, 0], 4),     // multicast
    ([240, 0, 0, 0], 4),     // reserved, and the broadcast address
];

/// IPv6 ranges no file URL may reach, as (network, prefix length). Ranges
/// that carry an IPv4 address to another network (NAT64, 6to4, Teredo)
/// are refused whole: the relay, not us, would pick the destination.
/// IPv4-mapped addresses (`::ffff:a.b.c.d`) are judged by their IPv4 half.
const V6_NOT_PUBLIC: [(u128, u8); 15] = [
    (0, 128),                                        // unspecified
    (1, 128),                                        // loopback
    (0, 96),                                         // IPv4-compatible (deprecated)
    (0x0064_ff9b_0000_0000_0000_0000_0000_0000, 96), // NAT64
    (0x0064_ff9b_0001_0000_0000_0000_0000_0000, 48), // local-use NAT64
    (0x0100_0000_0000_0000_0000_0000_0000_0000, 64), // discard only
    (0x2001_0000_0000_0000_0000_0000_0000_0000, 23), // IETF assignments, Teredo
    (0x2001_0db8_0000_0000_0000_0000_0000_0000, 32), // documentation
    (0x2002_0000_0000_0000_0000_0000_0000_0000, 16), // 6to4
    (0x3fff_0000_0000_0000_0000_0000_0000_0000, 20), // documentation
    (0x5f00_0000_0000_0000_0000_0000_0000_0000, 16), // segment routing SIDs
    (0xfc00_0000_0000_0000_0000_0000_0000_0000, 7),  // unique local
    (0xfe80_0000_0000_0000_0000_0000_0000_0000, 10), // link local
    (0xfec0_0000_0000_0000_0000_0000_0000_0000, 10), // site local (deprecated)
    (0xff00_0000_0000_0000_0000_0000_0000_0000, 8),  // multicast
];

/// Whether an address is outside the operator's own networks and reaches
/// the host it names.
fn public(ip: std::net::IpAddr) -> bool {
    use std::net::IpAddr;
    let within = |address: u128, network: u128, prefix: u8, bits: u8| {
        let shift = bits - prefix;
        prefix == 0 || address >> shift == network >> shift
    };
    match ip {
        IpAddr::V4(v4) => !V4_NOT_PUBLIC.iter().any(|(network, prefix)| {
            within(
                u32::from(v4).into(),
                u32::from_be_bytes(*network).into(),
                *prefix,
                32,
            )
        }),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return public(IpAddr::V4(v4));
            }
            !V6_NOT_PUBLIC
                .iter()
                .any(|(network, prefix)| within(u128::from(v6), *network, *prefix, 128))
        }
    }
}

/// Why a download stopped at its limit.
const TOO_LARGE: &str = "the file is larger than the bytes left for it";

/// Downloads `url`, at most `limit` bytes of it: (media type, bytes).
pub(crate) async fn fetch(
    url: &str,
    allow_private: bool,
    limit: usize,
) -> Result<(String, Vec<u8>), String> {
    let parsed = reqwest::Url::parse(url).map_err(|_| format!("{url:?} is not a URL"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err("URLs must be http or https".to_owned());
    }
    let host = parsed
        .host_str()
        .ok_or_else(|| "the file URL has no host".to_owned())?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = parsed.port_or_known_default().unwrap_or(443);
    let address = tokio::net::lookup_host((host.as_str(), port))
        .await
        .map_err(|_| format!("the host {host} cannot be resolved"))?
        .find(|a| allow_private || public(a.ip()))
        .ok_or_else(|| {
            format!("the host {host} is not a public address (send a file's content as file_data)")
        })?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    // The checked address, and no other: a second lookup could answer
    // differently (DNS rebinding); a redirect could go anywhere.
    let client = reqwest::Client::builder()
        .resolve(&host, address)
        // A proxy from HTTP(S)_PROXY would resolve the name again itself.
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(std::time::Duration::from_secs(15))
        .build()
        .map_err(|e| format!("cannot fetch files: {e}"))?;
    let mut response = client
        .get(parsed)
        .send()
        .await
        .map_err(|e| format!("{url} could not be fetched ({})", e.without_url()))?;
    if !response.status().is_success() {
        return Err(format!("fetching {url} answered {}", response.status()));
    }
    let media_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim().to_owned())
        .unwrap_or_default();
    let mut bytes = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("{url} could not be fetched ({})", e.without_url()))?
    {
        if bytes.len() + chunk.len() > limit {
            return Err(if limit == MAX_FILE_BYTES {
                format!("the file is larger than {MAX_FILE_BYTES} bytes")
            } else {
                TOO_LARGE.to_owned()
            });
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok((media_type, bytes))
}

/// Replaces every `file` part of the messages with a text part, read by
/// `converter`; the location (message, part) and reason of the first that
/// fails.
pub async fn convert(
    messages: &mut [Value],
    converter: &crate::convert::Converter,
) -> Result<(), (usize, usize, String)> {
    for (m, message) in messages.iter_mut().enumerate() {
        let Some(Value::Array(parts)) = message.get_mut("content") else {
            continue;
        };
        for (p, part) in parts.iter_mut().enumerate() {
            if part.get("type").and_then(Value::as_str) != Some("file") {
                continue;
            }
            let (name, media_type, bytes) =
                decode_part(&part["file"]).map_err(|why| (m, p, why))?;
            let text = converter
                .to_text(&name, &media_type, bytes)
                .await
                .map_err(|why| (m, p, why))?;
            *part = json!({"type": "text", "text": format!("File {name}:\n\n{text}")});
        }
    }
    Ok(())
}

/// Whether any message carries a `file` part (most requests: no).
pub fn any(messages: &[Value]) -> bool {
    file_parts(messages).next().is_some()
}

/// Every `file` part of the messages: (message, part, the part).
fn file_parts(messages: &[Value]) -> impl Iterator<Item = (usize, usize, &Value)> {
    messages.iter().enumerate().flat_map(|(m, message)| {
        message
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
            .filter(|(_, part)| part.get("type").and_then(Value::as_str) == Some("file"))
            .map(move |(p, part)| (m, p, part))
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub use rialto_test_kit::documents::archive;

    pub fn docx(text: &str) -> Vec<u8> {
        let xml = format!(
            r#"<?xml version="1.0" encoding="UTF-8"?><w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body><w:p><w:r><w:t>{text}</w:t></w:r></w:p><w:p><w:r><w:t xml:space="preserve">Second &amp; last</w:t></w:r></w:p></w:body></w:document>"#
        );
        archive(&[("word/document.xml", &xml)])
    }

    fn pdf(text: &str) -> Vec<u8> {
        use lopdf::content::{Content, Operation};
        use lopdf::{Document, Object, Stream, dictionary};
        let mut doc = Document::with_version("1.5");
        let pages_id = doc.new_object_id();
        let font_id = doc.add_object(dictionary! {
            "Type" => "Font", "Subtype" => "Type1", "BaseFont" => "Helvetica",
        });
        let resources_id = doc.add_object(dictionary! {
            "Font" => dictionary! { "F1" => font_id },
        });
        let content = Content {
            operations: vec![
                Operation::new("BT", vec![]),
                Operation::new("Tf", vec!["F1".into(), 24.into()]),
                Operation::new("Td", vec![100.into(), 600.into()]),
                Operation::new("Tj", vec![Object::string_literal(text)]),
                Operation::new("ET", vec![]),
            ],
        };
        let content_id = doc.add_object(Stream::new(dictionary! {}, content.encode().unwrap()));
        let page_id = doc.add_object(dictionary! {
            "Type" => "Page", "Parent" => pages_id, "Contents" => content_id,
        });
        doc.objects.insert(
            pages_id,
            Object::Dictionary(dictionary! {
                "Type" => "Pages", "Kids" => vec![page_id.into()], "Count" => 1,
                "Resources" => resources_id, "MediaBox" => vec![0.into(), 0.into(), 595.into(), 842.into()],
            }),
        );
        let catalog_id = doc.add_object(dictionary! { "Type" => "Catalog", "Pages" => pages_id });
        doc.trailer.set("Root", catalog_id);
        let mut bytes = Vec::new();
        doc.save_to(&mut bytes).unwrap();
        bytes
    }

    fn xlsx() -> Vec<u8> {
        let mut workbook = rust_xlsxwriter::Workbook::new();
        let sheet = workbook.add_worksheet().set_name("Prices").unwrap();
        sheet.write(0, 0, "model").unwrap();
        sheet.write(0, 1, "usd").unwrap();
        sheet.write(1, 0, "m-chat").unwrap();
        sheet.write(1, 1, 1.5).unwrap();
        workbook.save_to_buffer().unwrap()
    }

    #[test]
    fn each_format_converts() {
        assert_eq!(
            to_text("a.docx", "", &docx("Hello")).unwrap(),
            "Hello\nSecond & last"
        );
        let pptx = archive(&[
            (
                "ppt/slides/slide10.xml",
                r#"<p:sld xmlns:a="a" xmlns:p="p"><a:p><a:r><a:t>Ten</a:t></a:r></a:p></p:sld>"#,
            ),
            (
                "ppt/slides/slide2.xml",
                r#"<p:sld xmlns:a="a" xmlns:p="p"><a:p><a:r><a:t>Two</a:t></a:r></a:p></p:sld>"#,
            ),
        ]);
        assert_eq!(to_text("deck.pptx", "", &pptx).unwrap(), "Two\nTen");
        assert_eq!(
            to_text("prices.xlsx", "", &xlsx()).unwrap(),
            "# Prices\nmodel\tusd\nm-chat\t1.5"
        );
        let text = to_text("doc.pdf", "", &pdf("Hello from a PDF")).unwrap();
        assert!(text.contains("Hello from a PDF"), "{text:?}");
        assert_eq!(to_text("notes.md", "", b"# Title").unwrap(), "# Title");
        assert_eq!(
            to_text("data", "text/csv", b"a,b\n1,2").unwrap(),
            "a,b\n1,2"
        );
    }

    #[test]
    fn unreadable_files_say_why() {
        assert!(
            to_text("a.pdf", "", b"not a pdf")
                .unwrap_err()
                .contains("PDF")
        );
        assert!(
            to_text("a.docx", "", b"PK garbage")
                .unwrap_err()
                .contains("DOCX")
        );
        assert!(
            to_text("a.xlsx", "", &docx("x"))
                .unwrap_err()
                .contains("XLSX")
        );
        assert!(
            to_text("a.exe", "", b"MZ")
                .unwrap_err()
                .contains("not a supported file")
        );
        assert!(
            to_text("a.txt", "", &[0xff, 0xfe])
                .unwrap_err()
                .contains("UTF-8")
        );
    }

    #[tokio::test]
    async fn parts_become_text_parts() {
        let converter = crate::convert::Converter::in_process();
        let data = base64::engine::general_purpose::STANDARD.encode(docx("Inside"));
        let mut messages = vec![json!({"role": "user", "content": [
            {"type": "text", "text": "summarize"},
            {"type": "file", "file": {"filename": "a.docx",
                "file_data": format!("data:application/octet-stream;base64,{data}")}}]})];
        assert!(any(&messages));
        convert(&mut messages, &converter).await.unwrap();
        assert_eq!(messages[0]["content"][1]["type"], "text");
        assert!(
            messages[0]["content"][1]["text"]
                .as_str()
                .unwrap()
                .contains("Inside")
        );
        let mut bad = vec![json!({"role": "user", "content": [
            {"type": "file", "file": {"filename": "a.pdf", "file_data": "%%%"}}]})];
        let (m, p, why) = convert(&mut bad, &converter).await.unwrap_err();
        assert_eq!((m, p), (0, 0));
        assert!(why.contains("base64"), "{why}");
    }

    use rialto_test_kit::documents::{far_apart_cells, nested_pdf};
    #[test]
    fn deep_pdfs_and_sprawling_sheets_are_refused_before_parsing() {
        let why = precheck("deep.pdf", Format::Pdf, &nested_pdf(5_000)).unwrap_err();
        assert!(
            why.contains("\"deep.pdf\"") && why.contains("deep"),
            "{why}"
        );
        let why = precheck("wide.xlsx", Format::Xlsx, &far_apart_cells()).unwrap_err();
        assert!(
            why.contains("\"wide.xlsx\"") && why.contains("cells"),
            "{why}"
        );
        // Ordinary files pass, and so do brackets inside strings, comments
        // and streams, which are not syntax.
        precheck("doc.pdf", Format::Pdf, &pdf("Hello [[[[")).unwrap();
        precheck("shallow.pdf", Format::Pdf, &nested_pdf(MAX_PDF_NESTING)).unwrap();
        let mut noisy = b"%PDF-1.5\n% [[[[[[[[\n(((( [[[[[[ ))))\n".to_vec();
        noisy.extend_from_slice(b"<< /Length 100 >>\nstream\n");
        noisy.extend(std::iter::repeat_n(b'[', 1_000));
        noisy.extend_from_slice(b"\nendstream\n");
        precheck("noisy.pdf", Format::Pdf, &noisy).unwrap();
        precheck("prices.xlsx", Format::Xlsx, &xlsx()).unwrap();
        assert_eq!(cell_position(b"XFD1048576"), Some((1_048_576, 16_384)));
        assert_eq!(cell_position(b"B7"), Some((7, 2)));
        assert_eq!(cell_position(b"7"), None);
    }

    #[tokio::test]
    async fn a_request_carries_a_bounded_number_and_size_of_files() {
        let part =
            |data: &str| json!({"type": "file", "file": {"filename": "a.txt", "file_data": data}});
        let many: Vec<Value> = (0..=MAX_FILE_PARTS).map(|_| part("aGk=")).collect();
        let mut messages = vec![json!({"role": "user", "content": many})];
        let (m, p, why) = fetch_urls(&mut messages, false).await.unwrap_err();
        assert_eq!((m, p), (0, MAX_FILE_PARTS));
        assert!(why.contains("at most"), "{why}");
        // Three files of 7.5 MB: each under the file limit, over the
        // request's together.
        let big = "A".repeat(10 * 1024 * 1024);
        let mut messages =
            vec![json!({"role": "user", "content": [part(&big), part(&big), part(&big)]})];
        let (_, p, why) = fetch_urls(&mut messages, false).await.unwrap_err();
        assert_eq!(p, 2);
        assert!(why.contains("together"), "{why}");
    }

    #[test]
    fn an_archive_stops_expanding_at_the_text_cap() {
        // A slide of 5 MB of text: refused while it is read.
        let run = "x".repeat(MAX_TEXT_CHARS * 5);
        let slide = format!(
            r#"<p:sld xmlns:p="p" xmlns:a="a"><a:p><a:r><a:t>{run}</a:t></a:r></a:p></p:sld>"#
        );
        let deck = archive(&[("ppt/slides/slide1.xml", &slide)]);
        let why = to_text("deck.pptx", "", &deck).unwrap_err();
        assert!(why.contains("characters"), "{why}");
    }

    #[tokio::test]
    async fn urls_inside_the_network_are_refused() {
        for url in [
            "http://127.0.0.1:9/a.pdf",
            "http://10.0.0.1/a.pdf",
            "http://[::1]/a.pdf",
            "http://169.254.169.254/latest/meta-data",
            "file:///etc/passwd",
        ] {
            let mut messages = vec![json!({"role": "user", "content": [
                {"type": "file", "file": {"file_url": url}}]})];
            let (_, _, why) = fetch_urls(&mut messages, false).await.unwrap_err();
            assert!(
                why.contains("not a public address") || why.contains("http or https"),
                "{url}: {why}"
            );
        }
        assert!(!public("100.64.1.1".parse().unwrap()));
        assert!(!public("::ffff:192.168.1.1".parse().unwrap()));
        assert!(public("93.184.216.34".parse().unwrap()));
    }

    /// One address inside each refused range, and the public ones just
    /// outside some of them.
    #[test]
    fn a_page_is_its_article_with_its_title() {
        let page = r#"<html><head><title>Sky</title><script>var x = 1;</script></head><body>
            <nav><a href="/">Home</a></nav><article><h1>Sky</h1>
            <p>The sky is blue because air scatters short wavelengths of sunlight more than
            long ones, which is called Rayleigh scattering, and our eyes see the result.</p>
            <p>At sunset the light crosses more air, so the blue is scattered away and the
            reds and oranges remain, which is why evening skies glow in warm colours.</p>
            <p>Clouds are white because their droplets scatter every wavelength alike, and
            so the sunlight they send on keeps all of its colours mixed together.</p>
            </article><footer>(c) 2026</footer></body></html>"#;
        let text = to_text("sky.html", "", page.as_bytes()).unwrap();
        assert!(text.starts_with("# Sky\n\n"), "{text}");
        assert!(text.contains("Rayleigh scattering"), "{text}");
        assert!(!text.contains("var x"), "{text}");
    }

    #[test]
    fn a_page_of_links_is_its_whole_text() {
        let links: String = (0..40)
            .map(|i| format!("<li><a href=\"/r{i}\">Reference number {i}</a></li>"))
            .collect();
        let page = format!(
            "<html><head><title>References</title><style>p {{}}</style></head><body>\
             <div class=\"help\"><p>Press S to search.</p></div><ul>{links}</ul></body></html>"
        );
        let text = to_text("refs.html", "text/html", page.as_bytes()).unwrap();
        assert!(text.contains("Reference number 39"), "{text}");
        assert!(!text.contains("p {}"), "{text}");
    }

    #[test]
    fn every_special_range_is_refused() {
        for address in [
            "0.0.0.0",
            "0.1.2.3",
            "10.255.0.1",
            "100.127.255.255",
            "127.0.0.2",
            "169.254.169.254",
            "172.31.0.1",
            "192.0.0.8",
            "192.0.2.1",
            "192.88.99.1",
            "192.168.1.1",
            "198.18.0.1",
            "198.19.255.255",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "::127.0.0.1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b::8.8.8.8",
            "64:ff9b:1::1",
            "100::1",
            "2001::1",
            "2001:db8::1",
            "2002:a9fe:a9fe::1",
            "3fff::1",
            "5f00::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "fec0::1",
            "feff::1",
            "ff02::1",
        ] {
            let ip: std::net::IpAddr = address.parse().unwrap();
            assert!(!public(ip), "{address} passed as public");
        }
        for address in [
            "1.1.1.1",
            "8.8.8.8",
            "100.63.255.255",
            "100.128.0.0",
            "172.32.0.1",
            "198.17.255.255",
            "198.20.0.0",
            "223.255.255.255",
            "::ffff:8.8.8.8",
            "2001:4860:4860::8888",
            "2606:4700::1111",
        ] {
            let ip: std::net::IpAddr = address.parse().unwrap();
            assert!(public(ip), "{address} refused as private");
        }
    }
}

/// Properties: the checks before parsing take anything.
#[cfg(test)]
mod properties {
    use super::{Format, cell_position, pdf_nesting, precheck};
    use proptest::prelude::*;

    proptest! {
        /// Any bytes, under any format's name: a verdict, never a panic.
        #[test]
        fn prechecks_take_any_bytes(bytes in proptest::collection::vec(prop::num::u8::ANY, 0..4_096)) {
            for format in [Format::Pdf, Format::Docx, Format::Pptx, Format::Xlsx, Format::Text] {
                let _ = precheck("f", format, &bytes);
            }
        }

        /// PDF-like text: brackets, strings, escapes, comments and streams
        /// in any order and unbalanced: a verdict, never a panic.
        #[test]
        fn pdf_nesting_is_measured_outside_strings_and_streams(
            pieces in proptest::collection::vec(
                prop::sample::select(vec!["[", "]", "<<", ">>", "(", ")", "\\", "%", "\n", " stream\n", "endstream", "x"]),
                0..400,
            ),
        ) {
            let text = pieces.concat();
            let _ = pdf_nesting(text.as_bytes());
        }

        #[test]
        fn cell_references_are_read_or_refused(reference in "[A-Za-z]{0,5}[0-9]{0,22}") {
            if let Some((row, column)) = cell_position(reference.as_bytes()) {
                prop_assert!(row >= 1 && column >= 1);
            }
        }
    }
}
