//! The Prometheus text exposition format 0.0.4, derived from the OpenMetrics text that
//! `prometheus-client` writes, and the `Accept` negotiation between the two.
//!
//! Format 0.0.4 (<https://prometheus.io/docs/instrumenting/exposition_formats/>): a counter
//! family is named with its samples' `_total` suffix in `# HELP` and `# TYPE`; there is no
//! `# UNIT`, no `# EOF`, no exemplars, no `_created` samples, and no `info` or `stateset`
//! types (an `info` family becomes a gauge named `<name>_info`, the others `untyped`).
//! `promtool check metrics` reads this format: with the OpenMetrics names it reports every
//! counter as having no help text.

/// The content type of the Prometheus text format 0.0.4.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// The content type of OpenMetrics 1.0.0 text.
pub const OPENMETRICS_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Which exposition format a scrape gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    OpenMetrics,
    Prometheus,
}

impl Format {
    /// Chooses by the scraper's `Accept` header: OpenMetrics when it prefers
    /// `application/openmetrics-text` (the highest `q`, ties to OpenMetrics, as Prometheus
    /// asks with OpenMetrics first); the text format 0.0.4 for `text/plain`, `*/*`, no
    /// header, or anything else.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Prometheus;
        };
        let (mut om, mut text) = (0.0_f32, 0.0_f32);
        for item in accept.split(',') {
            let mut parts = item.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q="))
                .find_map(|q| q.parse::<f32>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" => om = om.max(q),
                "text/plain" | "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
        if om > 0.0 && om >= text {
            Format::OpenMetrics
        } else {
            Format::Prometheus
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => OPENMETRICS_TEXT,
            Format::Prometheus => PROMETHEUS_TEXT,
        }
    }
}

/// Rewrites OpenMetrics text into the Prometheus text format 0.0.4 (see the module docs).
pub fn openmetrics_to_prometheus(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    // The family being written: its OpenMetrics name and type.
    let mut family: Option<(String, String)> = None;
    let mut help: Option<(String, String)> = None;
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name.to_string(), text.to_string()));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (exposed, ty04) = match ty {
                "counter" if !name.ends_with("_total") => (format!("{name}_total"), "counter"),
                "counter" => (name.to_string(), "counter"),
                "gauge" | "histogram" | "summary" => (name.to_string(), ty),
                "info" => (format!("{name}_info"), "gauge"),
                _ => (name.to_string(), "untyped"),
            };
            let help_text = match help.take() {
                Some((n, t)) if n == name => t,
                _ => String::new(),
            };
            out.push_str(&format!("# HELP {exposed} {help_text}\n"));
            out.push_str(&format!("# TYPE {exposed} {ty04}\n"));
            family = Some((name.to_string(), ty.to_string()));
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            // `# UNIT`, `# EOF`.
            continue;
        }
        let sample = strip_exemplar(line);
        let name_end = sample.find(['{', ' ']).unwrap_or(sample.len());
        let name = &sample[..name_end];
        if let Some((fam, _)) = &family
            && name.strip_prefix(fam.as_str()) == Some("_created")
        {
            continue;
        }
        out.push_str(sample);
        out.push('\n');
    }
    out
}

/// A sample line without its exemplar (` # {labels} value [timestamp]` after the value).
fn strip_exemplar(line: &str) -> &str {
    // Label values may contain " # ": look after the label set only.
    let after_labels = match (line.find('{'), line.rfind('}')) {
        (Some(open), Some(close)) if open < line.find(' ').unwrap_or(usize::MAX) => {
            // The exemplar has its own `{...}`: the sample's label set closes at the first
            // `}` not inside a quoted value.
            closing_brace(line, open).unwrap_or(close) + 1
        }
        _ => 0,
    };
    match line[after_labels..].find(" # ") {
        Some(i) => &line[..after_labels + i],
        None => line,
    }
}

/// The index of the `}` closing the label set opened at `open`, skipping quoted values.
fn closing_brace(line: &str, open: usize) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in line[open..].char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(open + i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_headers_choose_the_format() {
        use Format::*;
        for (accept, want) in [
            (None, Prometheus),
            (Some("text/plain"), Prometheus),
            (Some("text/plain;version=0.0.4"), Prometheus),
            (Some("*/*"), Prometheus),
            (Some("application/openmetrics-text"), OpenMetrics),
            (
                Some("application/openmetrics-text; version=1.0.0; charset=utf-8"),
                OpenMetrics,
            ),
            // Prometheus' own scrape header.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
                ),
                OpenMetrics,
            ),
            (
                Some("application/openmetrics-text;q=0.2,text/plain;q=0.9"),
                Prometheus,
            ),
            (Some("application/openmetrics-text;q=0"), Prometheus),
            (Some("application/json"), Prometheus),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
    }

    #[test]
    fn openmetrics_becomes_text_0_0_4() {
        let om = "# HELP requests Requests served.\n\
                  # TYPE requests counter\n\
                  requests_total{code=\"200\"} 3\n\
                  requests_created{code=\"200\"} 1700000000.0\n\
                  # HELP latency_seconds Latency.\n\
                  # TYPE latency_seconds histogram\n\
                  # UNIT latency_seconds seconds\n\
                  latency_seconds_sum 1.5\n\
                  latency_seconds_count 2\n\
                  latency_seconds_bucket{le=\"+Inf\"} 2 # {trace_id=\"a # b}\"} 1.0\n\
                  # HELP build Build.\n\
                  # TYPE build info\n\
                  build_info{version=\"1\"} 1\n\
                  # HELP up Up.\n\
                  # TYPE up gauge\n\
                  up{q=\"x # y\"} 1\n\
                  # EOF\n";
        assert_eq!(
            openmetrics_to_prometheus(om),
            "# HELP requests_total Requests served.\n\
             # TYPE requests_total counter\n\
             requests_total{code=\"200\"} 3\n\
             # HELP latency_seconds Latency.\n\
             # TYPE latency_seconds histogram\n\
             latency_seconds_sum 1.5\n\
             latency_seconds_count 2\n\
             latency_seconds_bucket{le=\"+Inf\"} 2\n\
             # HELP build_info Build.\n\
             # TYPE build_info gauge\n\
             build_info{version=\"1\"} 1\n\
             # HELP up Up.\n\
             # TYPE up gauge\n\
             up{q=\"x # y\"} 1\n"
        );
    }
}
