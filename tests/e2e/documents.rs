//! Generated hostile documents through the gateway's converter as `rialto
//! serve` runs it: a child process of the real binary (`rialto
//! convert-file`), bounded in memory, CPU and time. Whatever the document,
//! the answer is its text or a reason naming it, within the time limit;
//! never a hang, and never anything that could reach the server.

use std::io::Write;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rialto_gateway::convert::{Converter, WALL_TIME};

fn converter() -> &'static Converter {
    static CONVERTER: OnceLock<Converter> = OnceLock::new();
    CONVERTER
        .get_or_init(|| Converter::subprocess(rialto_test_kit::sandbox::rialto_binary().unwrap()))
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| tokio::runtime::Runtime::new().unwrap())
}

/// Converts `bytes` named `name` and checks the outcome's shape.
fn convert(name: &str, bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let started = Instant::now();
    let outcome = runtime().block_on(converter().to_text(name, "", bytes));
    // The child's own bound, and a margin for a loaded machine.
    prop_assert!(started.elapsed() < WALL_TIME + Duration::from_secs(5));
    if let Err(why) = outcome {
        prop_assert!(
            why.contains(name) || why.contains("bytes") || why.contains("characters"),
            "a reason that does not name {}: {}",
            name,
            why
        );
    }
    Ok(())
}

/// PDF syntax: objects whose arrays and dictionaries nest to a drawn depth,
/// in the object or inside a page's content stream (where the checks before
/// parsing do not look), with or without a cross-reference table.
fn pdfs() -> impl Strategy<Value = Vec<u8>> {
    (
        0usize..6_000,
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec!["[", "<<", "[<< /A "]),
        proptest::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(|(depth, in_stream, xref, open, noise)| {
            let close = match open {
                "[" => "]",
                "<<" => ">>",
                _ => ">>]",
            };
            let nested = format!("{}1{}", open.repeat(depth), close.repeat(depth));
            let content = if in_stream {
                format!("BT /F1 12 Tf {nested} TJ ET")
            } else {
                "BT /F1 12 Tf (hello) Tj ET".to_owned()
            };
            let page_extra = if in_stream {
                String::new()
            } else {
                format!("/X {nested}")
            };
            let objects = [
                "<< /Type /Catalog /Pages 2 0 R >>".to_owned(),
                "<< /Type /Pages /Kids [3 0 R] /Count 1 >>".to_owned(),
                format!("<< /Type /Page /Parent 2 0 R /Contents 4 0 R {page_extra} >>"),
                format!(
                    "<< /Length {} >>\nstream\n{content}\nendstream",
                    content.len()
                ),
            ];
            let mut pdf = b"%PDF-1.5\n".to_vec();
            let mut offsets = Vec::new();
            for (i, object) in objects.iter().enumerate() {
                offsets.push(pdf.len());
                pdf.extend_from_slice(format!("{} 0 obj\n{object}\nendobj\n", i + 1).as_bytes());
            }
            pdf.extend_from_slice(&noise);
            if xref {
                let at = pdf.len();
                pdf.extend_from_slice(b"xref\n0 5\n0000000000 65535 f \n");
                for offset in offsets {
                    pdf.extend_from_slice(format!("{offset:010} 00000 n \n").as_bytes());
                }
                pdf.extend_from_slice(
                    format!("trailer << /Size 5 /Root 1 0 R >>\nstartxref\n{at}\n").as_bytes(),
                );
            }
            pdf.extend_from_slice(b"%%EOF\n");
            pdf
        })
}

/// An Office archive with one XML part: entries nested to a drawn depth,
/// text runs, and cell references anywhere on the sheet.
fn office(entry: &'static str, depth: usize, runs: usize, cells: &[(u32, u32)]) -> Vec<u8> {
    let mut xml = String::from(r#"<?xml version="1.0"?><root>"#);
    xml.push_str(&"<a:p>".repeat(depth));
    for i in 0..runs {
        xml.push_str(&format!("<a:t>run {i}</a:t>"));
    }
    xml.push_str(&"</a:p>".repeat(depth));
    xml.push_str("<sheetData>");
    for (row, column) in cells {
        let mut letters = String::new();
        let mut n = *column;
        while n > 0 {
            letters.insert(0, char::from(b'A' + ((n - 1) % 26) as u8));
            n = (n - 1) / 26;
        }
        xml.push_str(&format!(
            r#"<row r="{row}"><c r="{letters}{row}"><v>1</v></c></row>"#
        ));
    }
    xml.push_str("</sheetData></root>");
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    zip.start_file(entry, zip::write::SimpleFileOptions::default())
        .unwrap();
    zip.write_all(xml.as_bytes()).unwrap();
    if entry.starts_with("xl/") {
        for (name, body) in [
            (
                "xl/workbook.xml",
                r#"<?xml version="1.0"?><workbook xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships"><sheets><sheet name="S" sheetId="1" r:id="rId1"/></sheets></workbook>"#,
            ),
            (
                "xl/_rels/workbook.xml.rels",
                r#"<?xml version="1.0"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/worksheet" Target="worksheets/sheet1.xml"/></Relationships>"#,
            ),
        ] {
            zip.start_file(name, zip::write::SimpleFileOptions::default())
                .unwrap();
            zip.write_all(body.as_bytes()).unwrap();
        }
    }
    zip.finish().unwrap().into_inner()
}

proptest! {
    // Each case starts a process: a few dozen cases a format.
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn generated_pdfs_are_read_or_refused(pdf in pdfs()) {
        convert("generated.pdf", pdf)?;
    }

    #[test]
    fn generated_office_files_are_read_or_refused(
        depth in 0usize..20_000,
        runs in 0usize..50,
        cells in proptest::collection::vec((1u32..=1_048_576, 1u32..=16_384), 0..4),
        which in 0usize..3,
    ) {
        let (name, entry) = [
            ("generated.docx", "word/document.xml"),
            ("generated.pptx", "ppt/slides/slide1.xml"),
            ("generated.xlsx", "xl/worksheets/sheet1.xml"),
        ][which];
        convert(name, office(entry, depth, runs, &cells))?;
    }

    #[test]
    fn arbitrary_bytes_are_read_or_refused(
        bytes in proptest::collection::vec(any::<u8>(), 0..2_048),
        name in prop::sample::select(vec!["a.pdf", "a.docx", "a.pptx", "a.xlsx"]),
    ) {
        convert(name, bytes)?;
    }
}
