//! Documents for the file-part tests, hostile and plain, built in memory:
//! PDFs with a real cross-reference table or without one, and minimal
//! workbooks whose cells sit where the test wants them.

use std::io::Write;

/// A PDF of `objects` (numbered from 1, object 1 the catalog) with a
/// cross-reference table and a trailer, as a parser expects to find them.
pub fn pdf(objects: &[String]) -> Vec<u8> {
    let mut pdf = b"%PDF-1.5\n".to_vec();
    let mut offsets = Vec::new();
    for (i, object) in objects.iter().enumerate() {
        offsets.push(pdf.len());
        pdf.extend_from_slice(format!("{} 0 obj\n{object}\nendobj\n", i + 1).as_bytes());
    }
    let xref = pdf.len();
    let size = objects.len() + 1;
    pdf.extend_from_slice(format!("xref\n0 {size}\n0000000000 65535 f \n").as_bytes());
    for offset in offsets {
        pdf.extend_from_slice(format!("{offset:010} 00000 n \n").as_bytes());
    }
    pdf.extend_from_slice(
        format!("trailer << /Size {size} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n").as_bytes(),
    );
    pdf
}

/// A one-page PDF whose content stream is `content`.
pub fn page_pdf(content: &str) -> Vec<u8> {
    pdf(&[
        "<< /Type /Catalog /Pages 2 0 R >>".to_owned(),
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>".to_owned(),
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R \
         /Resources << /Font << /F1 5 0 R >> >> >>"
            .to_owned(),
        format!(
            "<< /Length {} >>\nstream\n{content}\nendstream",
            content.len()
        ),
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>".to_owned(),
    ])
}

/// A file whose first object nests arrays `depth` deep, without a
/// cross-reference table.
pub fn nested_pdf(depth: usize) -> Vec<u8> {
    let mut pdf = b"%PDF-1.5\n1 0 obj\n".to_vec();
    pdf.extend(std::iter::repeat_n(b'[', depth));
    pdf.extend(std::iter::repeat_n(b']', depth));
    pdf.extend_from_slice(b"\nendobj\ntrailer << /Root 1 0 R >>\n%%EOF\n");
    pdf
}

/// A zip archive of `entries` (name, content).
pub fn archive(entries: &[(&str, &str)]) -> Vec<u8> {
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for (name, content) in entries {
        // Writing to memory cannot fail.
        let _ = zip.start_file(*name, zip::write::SimpleFileOptions::default());
        let _ = zip.write_all(content.as_bytes());
    }
    zip.finish().map(|c| c.into_inner()).unwrap_or_default()
}

/// A workbook of one sheet whose `<sheetData>` is `sheet_data`.
pub fn workbook(sheet_data: &str) -> Vec<u8> {
    let sheet = format!(
        r#"<?xml version="1.0"?><worksheet xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main"><sheetData>{sheet_data}</sheetData></worksheet>"#
    );
    archive(&[
        (
            "[Content_Types].xml",
            r#"<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types"/>"#,
        ),
        (
            "xl/workbook.xml",
            r#"<?xml version="1.0"?><workbook xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships"><sheets><sheet name="S" sheetId="1" r:id="rId1"/></sheets></workbook>"#,
        ),
        (
            "xl/_rels/workbook.xml.rels",
            r#"<?xml version="1.0"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/worksheet" Target="worksheets/sheet1.xml"/></Relationships>"#,
        ),
        ("xl/worksheets/sheet1.xml", &sheet),
    ])
}

/// Two cells, at A1 and XFD1048576: a dense reader allocates ~550 GB.
pub fn far_apart_cells() -> Vec<u8> {
    workbook(
        r#"<row r="1"><c r="A1" t="inlineStr"><is><t>a</t></is></c></row><row r="1048576"><c r="XFD1048576" t="inlineStr"><is><t>b</t></is></c></row>"#,
    )
}
