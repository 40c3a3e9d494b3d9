//! The static token file: kube-apiserver's `--token-auth-file` CSV, parsed into rows.

/// One row of the static token file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenFileRow {
    pub token: String,
    pub user: String,
    pub uid: String,
    pub groups: Vec<String>,
}

/// Why the token file does not parse; lines are numbered from 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenFileError {
    #[error("line {line}: {source}")]
    Csv {
        line: usize,
        #[source]
        source: CsvError,
    },
    #[error("line {line}: want at least 3 columns (token,user,uid), got {got}")]
    Columns { line: usize, got: usize },
    #[error("line {line}: empty token or user")]
    EmptyTokenOrUser { line: usize },
}

/// A line that is not one CSV record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CsvError {
    #[error("bare quote in an unquoted field")]
    BareQuote,
    #[error("unterminated quoted field")]
    Unterminated,
}

/// Parses kube-apiserver's `--token-auth-file` CSV: `token,user,uid[,"group1,group2"]`
/// (further columns ignored, as the apiserver does). Lines starting with `#` and blank
/// lines are skipped.
pub fn parse_token_file(text: &str) -> Result<Vec<TokenFileRow>, TokenFileError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line_no = i + 1;
        let fields = csv_fields(line).map_err(|source| TokenFileError::Csv {
            line: line_no,
            source,
        })?;
        if fields.len() < 3 {
            return Err(TokenFileError::Columns {
                line: line_no,
                got: fields.len(),
            });
        }
        if fields[0].is_empty() || fields[1].is_empty() {
            return Err(TokenFileError::EmptyTokenOrUser { line: line_no });
        }
        let groups = fields
            .get(3)
            .map(|g| {
                g.split(',')
                    .map(str::trim)
                    .filter(|g| !g.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        out.push(TokenFileRow {
            token: fields[0].clone(),
            user: fields[1].clone(),
            uid: fields[2].clone(),
            groups,
        });
    }
    Ok(out)
}

/// One CSV record (RFC 4180 quoting: `"a,b"`, `""` for a quote).
fn csv_fields(line: &str) -> Result<Vec<String>, CsvError> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    let mut was_quoted = false;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                cur.push('"');
            }
            (true, '"') => quoted = false,
            (true, c) => cur.push(c),
            (false, '"') if cur.is_empty() && !was_quoted => {
                quoted = true;
                was_quoted = true;
            }
            (false, '"') => return Err(CsvError::BareQuote),
            (false, ',') => {
                fields.push(std::mem::take(&mut cur));
                was_quoted = false;
            }
            (false, c) => cur.push(c),
        }
    }
    if quoted {
        return Err(CsvError::Unterminated);
    }
    fields.push(cur);
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_file_rows_parse_like_kube_apiserver() {
        let rows = parse_token_file(
            "# comment\nt1,alice,u1,\"dev,ops\"\n\nt2,bob,u2\nt3,\"carol, c\",u3,solo\n",
        )
        .unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].token, "t1");
        assert_eq!(rows[0].groups, ["dev", "ops"]);
        assert!(rows[1].groups.is_empty());
        assert_eq!(rows[2].user, "carol, c");
        assert_eq!(rows[2].groups, ["solo"]);
        assert!(parse_token_file("t1,alice\n").is_err());
        assert!(parse_token_file("t1,\"alice,u1\n").is_err());
    }
}
