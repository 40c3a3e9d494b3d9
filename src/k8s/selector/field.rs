//! Field selectors (`fields.ParseSelector` in `k8s.io/apimachinery/pkg/fields/selector.go`):
//! terms, escaping, matching and the canonical string. Which fields a resource supports is
//! checked apart, in [`crate::k8s::fields`].

use std::borrow::Cow;
use std::fmt;

use super::SelectorError;

/// One field selector term: `field=value` (also written `==`) or `field!=value`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FieldTerm {
    field: String,
    value: String,
    equal: bool,
}

impl FieldTerm {
    /// The field name, e.g. `spec.nodeName`.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// The unescaped value.
    pub fn value(&self) -> &str {
        &self.value
    }

    /// `true` for `=` / `==`, `false` for `!=`.
    pub fn is_equal(&self) -> bool {
        self.equal
    }

    /// The same term on another field: the field label conversion evaluates an alias under
    /// the name it stands for (pods' `spec.host` as `spec.nodeName`).
    pub(crate) fn renamed(&self, field: &str) -> FieldTerm {
        FieldTerm {
            field: field.to_string(),
            value: self.value.clone(),
            equal: self.equal,
        }
    }
}

impl fmt::Display for FieldTerm {
    /// `hasTerm.String()` / `notHasTerm.String()`: `==` prints as `=`, the value is escaped.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = if self.equal { "=" } else { "!=" };
        write!(f, "{}{op}{}", self.field, escape_field_value(&self.value))
    }
}

/// A parsed field selector: the AND of its terms.
///
/// Terms are kept sorted by their printed form, so `parse(display(x)) == x`. Go sorts the raw
/// terms instead, which only orders differently when `==` or escapes are involved; the order
/// never changes what matches.
#[derive(Debug, Clone, PartialEq, Eq, Default, Hash)]
pub struct FieldSelector {
    terms: Vec<FieldTerm>,
}

impl FieldSelector {
    /// Parses a `fieldSelector` query value as `fields.ParseSelector` does; `""` selects
    /// everything. Field names are not checked here: see
    /// [`check_field_selector`](crate::k8s::fields::check_field_selector).
    ///
    /// # Errors
    ///
    /// [`SelectorError::Field`] with the apiserver's message for a term without an operator
    /// and for bad escapes in a value.
    pub fn parse(s: &str) -> Result<FieldSelector, SelectorError> {
        let mut parts = split_terms(s);
        parts.sort_unstable();
        let mut terms = Vec::with_capacity(parts.len());
        for part in parts {
            if part.is_empty() {
                continue;
            }
            let Some((lhs, op, rhs)) = split_term(part) else {
                return Err(SelectorError::Field(format!(
                    "invalid selector: '{s}'; can't understand '{part}'"
                )));
            };
            let value = unescape_field_value(rhs).map_err(SelectorError::Field)?;
            terms.push(FieldTerm {
                field: lhs.to_string(),
                value,
                equal: op != "!=",
            });
        }
        Ok(FieldSelector::from_terms(terms))
    }

    /// The selector of these terms, in canonical order.
    pub(crate) fn from_terms(mut terms: Vec<FieldTerm>) -> FieldSelector {
        terms.sort_by_cached_key(|t| t.to_string());
        FieldSelector { terms }
    }

    /// Whether an object with these field values is selected; `fields(name)` returns the
    /// value, and a missing field counts as `""` (`fields.Set.Get`).
    pub fn matches<'a>(&self, fields: impl Fn(&str) -> Option<&'a str>) -> bool {
        self.terms
            .iter()
            .all(|t| (fields(&t.field).unwrap_or("") == t.value) == t.equal)
    }

    /// Whether the selector selects everything (no terms).
    pub fn is_everything(&self) -> bool {
        self.terms.is_empty()
    }

    /// The field names used, in term order (a name repeats if several terms use it).
    pub fn fields(&self) -> impl Iterator<Item = &str> {
        self.terms.iter().map(|t| t.field.as_str())
    }

    /// The terms, in canonical order.
    pub fn terms(&self) -> &[FieldTerm] {
        &self.terms
    }

    /// The single value required by `field=value` / `field==value` for `field`, if the
    /// selector pins it (for index lookups, e.g. `spec.nodeName`, `metadata.namespace`).
    ///
    /// Like `RequiresExactMatch`, the first `=` term wins; a selector pinning one field to two
    /// values selects nothing, so either answer is a correct index key.
    pub fn exact_value(&self, field: &str) -> Option<&str> {
        self.terms
            .iter()
            .find(|t| t.equal && t.field == field)
            .map(|t| t.value.as_str())
    }
}

impl fmt::Display for FieldSelector {
    /// `andTerm.String()`: terms joined by `,`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, t) in self.terms.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{t}")?;
        }
        Ok(())
    }
}

/// `fields.splitTerms`: split on commas not escaped by a backslash (escapes stay in place).
fn split_terms(s: &str) -> Vec<&str> {
    if s.is_empty() {
        return Vec::new();
    }
    let mut terms = Vec::with_capacity(1);
    let mut start = 0;
    let mut in_slash = false;
    for (i, c) in s.char_indices() {
        if in_slash {
            in_slash = false;
        } else if c == '\\' {
            in_slash = true;
        } else if c == ',' {
            terms.push(&s[start..i]);
            start = i + 1;
        }
    }
    terms.push(&s[start..]);
    terms
}

/// `fields.splitTerm`: the first occurrence of `!=`, `==` or `=` (checked in that order at
/// each position) splits field from raw value.
fn split_term(term: &str) -> Option<(&str, &'static str, &str)> {
    for (i, _) in term.char_indices() {
        let rest = &term[i..];
        for op in ["!=", "==", "="] {
            if rest.starts_with(op) {
                return Some((&term[..i], op, &term[i + op.len()..]));
            }
        }
    }
    None
}

/// `fields.UnescapeValue`.
fn unescape_field_value(s: &str) -> Result<String, String> {
    if !s.contains(['\\', ',', '=']) {
        return Ok(s.to_string());
    }
    let mut out = String::with_capacity(s.len());
    let mut in_slash = false;
    for c in s.chars() {
        if in_slash {
            match c {
                '\\' | ',' | '=' => out.push(c),
                _ => {
                    return Err(format!(
                        "invalid field selector: invalid escape sequence: \\{c}"
                    ));
                }
            }
            in_slash = false;
            continue;
        }
        match c {
            '\\' => in_slash = true,
            // Go formats the rune with %v, which prints its code point as a number.
            ',' | '=' => {
                return Err(format!(
                    "invalid field selector: unescaped character in value: {}",
                    c as u32
                ));
            }
            _ => out.push(c),
        }
    }
    if in_slash {
        return Err("invalid field selector: invalid escape sequence: \\".to_string());
    }
    Ok(out)
}

/// `fields.EscapeValue`: backslash-escape `\`, `,` and `=`.
pub fn escape_field_value(s: &str) -> Cow<'_, str> {
    if !s.contains(['\\', ',', '=']) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 4);
    for c in s.chars() {
        if matches!(c, '\\' | ',' | '=') {
            out.push('\\');
        }
        out.push(c);
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fields<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<&'a str> {
        move |k| pairs.iter().find(|(key, _)| *key == k).map(|(_, v)| *v)
    }

    fn field_err(s: &str) -> String {
        match FieldSelector::parse(s) {
            Err(SelectorError::Field(m)) => m,
            other => panic!("{s:?}: expected a field error, got {other:?}"),
        }
    }

    #[test]
    fn field_selectors_parse_to_the_canonical_string() {
        let cases = [
            ("", ""),
            (",", ""),
            ("a=b", "a=b"),
            ("a==b", "a=b"),
            ("a!=b", "a!=b"),
            ("b=1,a=2", "a=2,b=1"),
            ("a=", "a="),
            ("=a", "=a"),
            (r"a=x\,y", r"a=x\,y"),
            (r"a=x\=y", r"a=x\=y"),
            (r"a=x\\y", r"a=x\\y"),
            ("a!b=c", "a!b=c"),
            (
                "spec.nodeName=n1,metadata.namespace=ns",
                "metadata.namespace=ns,spec.nodeName=n1",
            ),
        ];
        for (input, want) in cases {
            let sel = FieldSelector::parse(input).unwrap_or_else(|e| panic!("{input:?}: {e}"));
            assert_eq!(sel.to_string(), want, "input {input:?}");
        }
        let sel = FieldSelector::parse(r"a=x\,y\=z\\").unwrap();
        assert_eq!(sel.terms()[0].value(), r"x,y=z\");
    }

    #[test]
    fn invalid_field_selectors_fail_with_the_apiservers_message() {
        let cases = [
            ("a", "invalid selector: 'a'; can't understand 'a'"),
            ("a=b,c", "invalid selector: 'a=b,c'; can't understand 'c'"),
            (
                "a=b=c",
                "invalid field selector: unescaped character in value: 61",
            ),
            ("a==b,c", "invalid selector: 'a==b,c'; can't understand 'c'"),
            (
                "a!==b",
                "invalid field selector: unescaped character in value: 61",
            ),
            (
                r"a=\x",
                r"invalid field selector: invalid escape sequence: \x",
            ),
            (
                r"a=x\",
                r"invalid field selector: invalid escape sequence: \",
            ),
        ];
        for (input, want) in cases {
            assert_eq!(field_err(input), want, "input {input:?}");
        }
    }

    #[test]
    fn field_selectors_treat_missing_fields_as_empty() {
        let obj = [("spec.nodeName", "n1"), ("status.phase", "Running")];
        let cases: &[(&str, bool)] = &[
            ("", true),
            ("spec.nodeName=n1", true),
            ("spec.nodeName==n1", true),
            ("spec.nodeName=n2", false),
            ("spec.nodeName!=n2", true),
            ("spec.nodeName!=n1", false),
            ("spec.nodeName=n1,status.phase=Running", true),
            ("spec.nodeName=n1,status.phase!=Running", false),
            ("missing=", true),
            ("missing!=", false),
            ("missing!=x", true),
            ("missing=x", false),
        ];
        for (sel, want) in cases {
            let parsed = FieldSelector::parse(sel).unwrap();
            assert_eq!(parsed.matches(fields(&obj)), *want, "{sel:?}");
        }
    }

    #[test]
    fn field_exact_value_pins_only_equality_terms() {
        let sel = FieldSelector::parse("spec.nodeName=n1,status.phase!=Failed").unwrap();
        assert_eq!(sel.exact_value("spec.nodeName"), Some("n1"));
        assert_eq!(sel.exact_value("status.phase"), None);
        assert_eq!(sel.exact_value("metadata.namespace"), None);
        assert_eq!(
            sel.fields().collect::<Vec<_>>(),
            ["spec.nodeName", "status.phase"]
        );
    }

    // ----- properties -----

    fn field_value() -> impl Strategy<Value = String> {
        "[ab\\\\,=!x0-9]{0,6}"
    }

    fn field_selector_text() -> impl Strategy<Value = String> {
        proptest::collection::vec(("[a-c][a-c.]{0,4}", 0..3u8, field_value()), 0..5).prop_map(
            |terms| {
                terms
                    .into_iter()
                    .map(|(f, op, v)| {
                        let op = ["=", "==", "!="][op as usize];
                        format!("{f}{op}{}", escape_field_value(&v))
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            },
        )
    }

    proptest! {
        #[test]
        fn field_selectors_round_trip_through_their_string(
            text in field_selector_text(),
            obj in proptest::collection::vec(("[a-c][a-c.]{0,4}", field_value()), 0..6),
        ) {
            let sel = FieldSelector::parse(&text).unwrap();
            let printed = sel.to_string();
            let again = FieldSelector::parse(&printed).unwrap();
            prop_assert_eq!(&again, &sel);
            prop_assert_eq!(again.to_string(), printed);
            let lookup = |k: &str| obj.iter().find(|(f, _)| f == k).map(|(_, v)| v.as_str());
            prop_assert_eq!(sel.matches(lookup), again.matches(lookup));
        }

        #[test]
        fn field_parsing_never_panics(s in "[ a-z0-9=!,\\\\.]{0,20}") {
            let _ = FieldSelector::parse(&s);
        }
    }
}
