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
//! [`MAX_TEXT_CHARS`] of text per file. A file that cannot be read is a 400
//! naming its part, never a 500. Conversion runs on the blocking pool: a
//! large PDF must not stall the gateway's workers.

use std::io::{Cursor, Read};

use base64::Engine;
use serde_json::{Value, json};

/// The largest file accepted, decoded.
pub const MAX_FILE_BYTES: usize = 10 * 1024 * 1024;
/// The most text one file may become.
pub const MAX_TEXT_CHARS: usize = 1_000_000;
/// The most entries of a DOCX, PPTX or XLSX archive read (zip bombs).
const MAX_ARCHIVE_BYTES: u64 = 64 * 1024 * 1024;

/// A file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Pdf,
    Docx,
    Pptx,
    Xlsx,
    Text,
}

fn format_of(name: &str, media_type: &str) -> Option<Format> {
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
        (Some("txt" | "csv" | "md" | "markdown"), _)
        | (_, "text/plain" | "text/csv" | "text/markdown") => Some(Format::Text),
        _ => None,
    }
}

/// The text of a file, or why it cannot be read.
pub fn to_text(name: &str, media_type: &str, bytes: &[u8]) -> Result<String, String> {
    let format = format_of(name, media_type).ok_or_else(|| {
        format!("{name:?} is not a supported file: send PDF, DOCX, PPTX, XLSX, TXT, CSV or MD")
    })?;
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
    };
    if text.chars().count() > MAX_TEXT_CHARS {
        return Err(format!(
            "{name:?} holds more than {MAX_TEXT_CHARS} characters of text"
        ));
    }
    Ok(text)
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
    for name in names {
        let mut xml = Vec::new();
        archive
            .by_name(&name)
            .map_err(|e| e.to_string())?
            .take(MAX_ARCHIVE_BYTES)
            .read_to_end(&mut xml)
            .map_err(|e| e.to_string())?;
        let mut reader = quick_xml::Reader::from_reader(xml.as_slice());
        let mut buffer = Vec::new();
        let mut inside = false;
        loop {
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
pub async fn fetch_urls(
    messages: &mut [Value],
    allow_private: bool,
) -> Result<(), (usize, usize, String)> {
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
            let (media_type, bytes) = fetch(&url, allow_private)
                .await
                .map_err(|why| (m, p, why))?;
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

/// Whether an address is outside the operator's own networks.
fn public(ip: std::net::IpAddr) -> bool {
    use std::net::IpAddr;
    match ip {
        IpAddr::V4(v4) => {
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                // 100.64.0.0/10, carrier-grade NAT.
                || (v4.octets()[0] == 100 && (v4.octets()[1] & 0xc0) == 64))
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                // fc00::/7 unique local, fe80::/10 link local.
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80)
        }
    }
}

/// Downloads `url`: (media type, bytes).
async fn fetch(url: &str, allow_private: bool) -> Result<(String, Vec<u8>), String> {
    let parsed = reqwest::Url::parse(url).map_err(|_| format!("{url:?} is not a URL"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err("file URLs must be http or https".to_owned());
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
        .map_err(|_| format!("the file URL's host {host} cannot be resolved"))?
        .find(|a| allow_private || public(a.ip()))
        .ok_or_else(|| {
            format!(
                "the file URL's host {host} is not a public address; send the file as file_data"
            )
        })?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    // The checked address, and no other: a second lookup could answer
    // differently (DNS rebinding); a redirect could go anywhere.
    let client = reqwest::Client::builder()
        .resolve(&host, address)
        .redirect(reqwest::redirect::Policy::none())
        .timeout(std::time::Duration::from_secs(15))
        .build()
        .map_err(|e| format!("cannot fetch files: {e}"))?;
    let mut response = client
        .get(parsed)
        .send()
        .await
        .map_err(|e| format!("the file could not be fetched ({})", e.without_url()))?;
    if !response.status().is_success() {
        return Err(format!("fetching the file answered {}", response.status()));
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
        .map_err(|e| format!("the file could not be fetched ({})", e.without_url()))?
    {
        if bytes.len() + chunk.len() > MAX_FILE_BYTES {
            return Err(format!("the file is larger than {MAX_FILE_BYTES} bytes"));
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok((media_type, bytes))
}

/// Replaces every `file` part of the messages with a text part; the
/// location (message, part) and reason of the first that fails.
pub fn convert(messages: &mut [Value]) -> Result<(), (usize, usize, String)> {
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
            let text = to_text(&name, &media_type, &bytes).map_err(|why| (m, p, why))?;
            *part = json!({"type": "text", "text": format!("File {name}:\n\n{text}")});
        }
    }
    Ok(())
}

/// Whether any message carries a `file` part (most requests: no).
pub fn any(messages: &[Value]) -> bool {
    messages.iter().any(|message| {
        message
            .get("content")
            .and_then(Value::as_array)
            .is_some_and(|parts| {
                parts
                    .iter()
                    .any(|p| p.get("type").and_then(Value::as_str) == Some("file"))
            })
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;

    /// An Office archive with `entries` (name, XML).
    pub fn archive(entries: &[(&str, &str)]) -> Vec<u8> {
        let mut writer = zip::ZipWriter::new(Cursor::new(Vec::new()));
        for (name, xml) in entries {
            writer
                .start_file(*name, zip::write::SimpleFileOptions::default())
                .unwrap();
            writer.write_all(xml.as_bytes()).unwrap();
        }
        writer.finish().unwrap().into_inner()
    }

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

    #[test]
    fn parts_become_text_parts() {
        let data = base64::engine::general_purpose::STANDARD.encode(docx("Inside"));
        let mut messages = vec![json!({"role": "user", "content": [
            {"type": "text", "text": "summarize"},
            {"type": "file", "file": {"filename": "a.docx",
                "file_data": format!("data:application/octet-stream;base64,{data}")}}]})];
        assert!(any(&messages));
        convert(&mut messages).unwrap();
        assert_eq!(messages[0]["content"][1]["type"], "text");
        assert!(
            messages[0]["content"][1]["text"]
                .as_str()
                .unwrap()
                .contains("Inside")
        );
        let mut bad = vec![json!({"role": "user", "content": [
            {"type": "file", "file": {"filename": "a.pdf", "file_data": "%%%"}}]})];
        let (m, p, why) = convert(&mut bad).unwrap_err();
        assert_eq!((m, p), (0, 0));
        assert!(why.contains("base64"), "{why}");
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
}
