//! The Prometheus text exposition format (and OpenMetrics text), as far as the load signals
//! need it: sample lines with their name, labels (escapes unescaped) and value (`NaN`,
//! `+Inf`, `-Inf` included). Kept by hand rather than taken from a crate: the crates for it
//! either leave label escapes unprocessed or give up on a whole exposition for one line they
//! reject, and this parser checks the metric name before it parses labels, so the thousands
//! of unwanted lines of an apiserver's `/metrics` cost little.

/// One sample line of the Prometheus text format (or OpenMetrics text).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

impl Sample<'_> {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The samples of `text` whose metric name `wanted` accepts. Comments, blank lines and lines
/// that do not parse are skipped; the name is checked before the labels are parsed, so the
/// many unwanted lines of a big exposition cost little.
pub fn parse_samples<'a>(text: &'a str, wanted: impl Fn(&str) -> bool) -> Vec<Sample<'a>> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim_start();
            if line.is_empty() || line.starts_with('#') {
                return None;
            }
            let end = line
                .find(|c: char| c == '{' || c.is_ascii_whitespace())
                .unwrap_or(line.len());
            let name = &line[..end];
            if name.is_empty() || !wanted(name) {
                return None;
            }
            parse_line(name, &line[end..])
        })
        .collect()
}

/// Parses `{labels} value [timestamp]` after the metric name.
fn parse_line<'a>(name: &'a str, rest: &'a str) -> Option<Sample<'a>> {
    let mut labels = Vec::new();
    let mut rest = rest.trim_start();
    if let Some(mut r) = rest.strip_prefix('{') {
        loop {
            r = r.trim_start();
            if let Some(after) = r.strip_prefix('}') {
                r = after;
                break;
            }
            let eq = r.find('=')?;
            let key = r[..eq].trim();
            if key.is_empty() {
                return None;
            }
            r = r[eq + 1..].trim_start().strip_prefix('"')?;
            let mut value = String::new();
            let mut chars = r.char_indices();
            let close = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (_, c) => value.push(c),
                }
            };
            labels.push((key, value));
            r = r[close + 1..].trim_start();
            if let Some(after) = r.strip_prefix(',') {
                r = after;
            } else if !r.starts_with('}') {
                return None;
            }
        }
        rest = r;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next()?)?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

pub(super) fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parser_reads_names_labels_escapes_and_special_values() {
        let text = "# HELP x y\n\
            a 1\n\
            a{} 2 1700000000000\n\
            a{k=\"v\",j=\"say \\\"hi\\\"\\\\\\n\",} 3\n\
            a { k = \"sp aced\" } 4\n\
            a{le=\"+Inf\"} +Inf\n\
            a NaN\n\
            a 1e3\n\
            b 9\n\
            a{k=\"unterminated} 5\n\
            a{k} 6\n\
            a\n\
            \n";
        let s = parse_samples(text, |n| n == "a");
        let values: Vec<f64> = s.iter().map(|s| s.value).collect();
        assert_eq!(values.len(), 7, "{s:?}");
        assert_eq!(&values[..5], &[1.0, 2.0, 3.0, 4.0, f64::INFINITY]);
        assert!(values[5].is_nan());
        assert_eq!(values[6], 1000.0);
        assert_eq!(s[2].label("k"), Some("v"));
        assert_eq!(s[2].label("j"), Some("say \"hi\"\\\n"));
        assert_eq!(s[3].label("k"), Some("sp aced"));
        assert_eq!(s[4].label("le"), Some("+Inf"));
    }
}
