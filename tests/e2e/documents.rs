//! Generated hostile documents through the gateway's converter as `rialto
//! serve` runs it: a child process of the real binary (`rialto
//! convert-file`), bounded in memory, CPU and time. Whatever the document,
//! the answer is its text or a reason naming it, within the time limit;
//! never a hang, and never anything that could reach the server.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rialto_gateway::convert::{Converter, WALL_TIME};
use rialto_test_kit::documents;

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
            let mut pdf = if xref {
                documents::pdf(&objects)
            } else {
                let mut pdf = b"%PDF-1.5\n".to_vec();
                for (i, object) in objects.iter().enumerate() {
                    pdf.extend_from_slice(
                        format!("{} 0 obj\n{object}\nendobj\n", i + 1).as_bytes(),
                    );
                }
                pdf
            };
            pdf.extend_from_slice(&noise);
            pdf
        })
}

/// An Office file with one XML part: elements nested to a drawn depth,
/// text runs, and (in a workbook) cells anywhere on the sheet.
fn office(entry: &'static str, depth: usize, runs: usize, cells: &[(u32, u32)]) -> Vec<u8> {
    let mut xml = "<a:p>".repeat(depth);
    for i in 0..runs {
        xml.push_str(&format!("<a:t>run {i}</a:t>"));
    }
    xml.push_str(&"</a:p>".repeat(depth));
    if entry.starts_with("xl/") {
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
        return documents::workbook(&xml);
    }
    documents::archive(&[(
        entry,
        &format!(r#"<?xml version="1.0"?><root>{xml}</root>"#),
    )])
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
