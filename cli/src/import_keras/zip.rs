//! Reading `config.json` out of a `.keras` file: a zip archive that Keras writes with its
//! entries stored (not compressed), found through the central directory. A compressed
//! entry is an error that says how to get the JSON instead.

/// The bytes of entry `wanted` of the zip archive `archive`.
pub fn stored_entry(archive: &[u8], wanted: &str) -> Result<Vec<u8>, String> {
    let u16_at = |offset: usize| -> Option<usize> {
        archive
            .get(offset..offset + 2)
            .map(|bytes| u16::from_le_bytes([bytes[0], bytes[1]]) as usize)
    };
    let u32_at = |offset: usize| -> Option<usize> {
        archive
            .get(offset..offset + 4)
            .map(|bytes| u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize)
    };
    let not_zip = || "not a .keras file (no zip directory)".to_string();
    // The end-of-central-directory record: its signature within the last 64 KiB + 22.
    let search_from = archive.len().saturating_sub(22 + 65_535);
    let end = (search_from..archive.len().saturating_sub(21))
        .rev()
        .find(|offset| archive[*offset..].starts_with(b"PK\x05\x06"))
        .ok_or_else(not_zip)?;
    let entries = u16_at(end + 10).ok_or_else(not_zip)?;
    let mut offset = u32_at(end + 16).ok_or_else(not_zip)?;
    for _ in 0..entries {
        if !archive
            .get(offset..)
            .is_some_and(|rest| rest.starts_with(b"PK\x01\x02"))
        {
            return Err(not_zip());
        }
        let method = u16_at(offset + 10).ok_or_else(not_zip)?;
        let compressed_size = u32_at(offset + 20).ok_or_else(not_zip)?;
        let name_length = u16_at(offset + 28).ok_or_else(not_zip)?;
        let extra_length = u16_at(offset + 30).ok_or_else(not_zip)?;
        let comment_length = u16_at(offset + 32).ok_or_else(not_zip)?;
        let local_header = u32_at(offset + 42).ok_or_else(not_zip)?;
        let name = archive
            .get(offset + 46..offset + 46 + name_length)
            .ok_or_else(not_zip)?;
        if name == wanted.as_bytes() {
            if method != 0 {
                return Err(format!(
                    "{wanted} is compressed in this .keras file; unzip it and import {wanted} itself"
                ));
            }
            let local_name = u16_at(local_header + 26).ok_or_else(not_zip)?;
            let local_extra = u16_at(local_header + 28).ok_or_else(not_zip)?;
            let start = local_header + 30 + local_name + local_extra;
            return archive
                .get(start..start + compressed_size)
                .map(<[u8]>::to_vec)
                .ok_or_else(not_zip);
        }
        offset += 46 + name_length + extra_length + comment_length;
    }
    Err(format!("the .keras file has no {wanted}"))
}
