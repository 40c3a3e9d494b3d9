//! Kubernetes label and field selectors, parsed and evaluated exactly as kube-apiserver does.
//!
//! The proxy answers lists and watches from memory, so a selector must select precisely the
//! objects the apiserver would select, and a malformed selector must fail with the apiserver's
//! own message (the proxy wraps it in a 400 `BadRequest` Status, as the list handler does with
//! `errors.NewBadRequest(err.Error())`).
//!
//! Sources, ported line by line where behaviour depends on it:
//!
//! - label selectors: `k8s.io/apimachinery/pkg/labels/selector.go` (lexer, parser,
//!   `NewRequirement`, `Requirement.Matches`, `Requirement.String`), key and value rules from
//!   `k8s.io/apimachinery/pkg/api/validate/content` (`IsLabelKey`, `IsLabelValue`), error text
//!   from `k8s.io/apimachinery/pkg/util/validation/field` (`field.Invalid`, `ToAggregate`);
//! - field selectors: `k8s.io/apimachinery/pkg/fields/selector.go` (`ParseSelector`,
//!   `splitTerms`, `splitTerm`, `UnescapeValue`, `EscapeValue`);
//! - which fields each kind accepts: the field label conversion functions the apiserver applies
//!   before storage sees the selector (`ListResource` → `FieldSelector.Transform` →
//!   `Scheme.ConvertFieldLabel`), in `pkg/apis/core/v1/conversion.go`,
//!   `pkg/apis/batch/v1/conversion.go`, `pkg/apis/certificates/v1/conversion.go`, and
//!   `runtime.DefaultMetaV1FieldSelectorConversion` for kinds without one; for custom
//!   resources, `crConverter.ConvertFieldLabel` (apiextensions-apiserver
//!   `pkg/apiserver/conversion/converter.go`): metadata, plus the CRD version's
//!   `selectableFields` ([`CustomFields`]);
//! - the values those fields have: the registries' `GetAttrs` / `ToSelectableFields`
//!   (`pkg/registry/core/pod/strategy.go` and friends), which read the *internal* object, so
//!   v1 → internal conversion quirks (pod `status.podIP`, `spec.serviceAccount`) are applied
//!   here; for custom resources, the CR strategy's `selectableFields`
//!   (apiextensions-apiserver `pkg/registry/customresource/strategy.go`): `fmt.Sprint` of the
//!   value each JSONPath finds in the unstructured object, `""` when absent or null.
//!
//! What the proxy cannot evaluate with certainty is reported as [`FieldCheck::Passthrough`]:
//! the apiserver then answers, and the proxy never guesses.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use crate::k8s::Resource;
use crate::k8s::scan::{Scalar, ScanError, Scanner};

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

/// A selector that could not be parsed, or a field the resource does not support.
///
/// `Display` is exactly the message kube-apiserver puts in its 400 `BadRequest` Status for the
/// same query, so the proxy can answer without asking upstream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// `labelSelector` is malformed, e.g. `unable to parse requirement: ...`.
    #[error("{0}")]
    Label(String),
    /// `fieldSelector` is malformed, e.g. `invalid selector: ...` or
    /// `invalid field selector: ...`.
    #[error("{0}")]
    Field(String),
    /// `fieldSelector` names a field the resource does not support, e.g.
    /// `field label not supported: spec.foo`.
    #[error("{0}")]
    UnsupportedField(String),
}

// ---------------------------------------------------------------------------------------------
// Label selectors
// ---------------------------------------------------------------------------------------------

/// The operator of one label requirement (`k8s.io/apimachinery/pkg/selection`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operator {
    /// `key in (a,b)`
    In,
    /// `key notin (a,b)`: also true when the key is absent.
    NotIn,
    /// `key=a`
    Equals,
    /// `key==a`: same meaning as `=`, kept apart because `String()` prints it back as `==`.
    DoubleEquals,
    /// `key!=a`: also true when the key is absent.
    NotEquals,
    /// `key`
    Exists,
    /// `!key`
    DoesNotExist,
    /// `key>5`: integer comparison; false when the key is absent or not an integer.
    GreaterThan,
    /// `key<5`: integer comparison; false when the key is absent or not an integer.
    LessThan,
}

/// One requirement of a label selector: key, operator and a sorted, de-duplicated value set.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Requirement {
    key: String,
    operator: Operator,
    values: Vec<String>,
}

impl Requirement {
    /// The label key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The operator.
    pub fn operator(&self) -> Operator {
        self.operator
    }

    /// The values, sorted and unique (empty for `Exists` / `DoesNotExist`).
    pub fn values(&self) -> &[String] {
        &self.values
    }

    fn has_value(&self, v: &str) -> bool {
        self.values.iter().any(|x| x == v)
    }

    /// `Requirement.Matches`.
    fn matches<'a>(&self, labels: &impl Fn(&str) -> Option<&'a str>) -> bool {
        let got = labels(&self.key);
        match self.operator {
            Operator::In | Operator::Equals | Operator::DoubleEquals => {
                got.is_some_and(|v| self.has_value(v))
            }
            Operator::NotIn | Operator::NotEquals => got.is_none_or(|v| !self.has_value(v)),
            Operator::Exists => got.is_some(),
            Operator::DoesNotExist => got.is_none(),
            Operator::GreaterThan | Operator::LessThan => {
                // strconv.ParseInt(s, 10, 64) accepts the same inputs as i64::from_str:
                // optional sign, decimal digits, no whitespace or underscores.
                let Some(have) = got.and_then(|v| v.parse::<i64>().ok()) else {
                    return false;
                };
                let [want] = self.values.as_slice() else {
                    return false;
                };
                let Ok(want) = want.parse::<i64>() else {
                    return false;
                };
                if self.operator == Operator::GreaterThan {
                    have > want
                } else {
                    have < want
                }
            }
        }
    }
}

impl fmt::Display for Requirement {
    /// `Requirement.String()`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.operator == Operator::DoesNotExist {
            f.write_str("!")?;
        }
        f.write_str(&self.key)?;
        let op = match self.operator {
            Operator::Equals => "=",
            Operator::DoubleEquals => "==",
            Operator::NotEquals => "!=",
            Operator::In => " in ",
            Operator::NotIn => " notin ",
            Operator::GreaterThan => ">",
            Operator::LessThan => "<",
            Operator::Exists | Operator::DoesNotExist => return Ok(()),
        };
        f.write_str(op)?;
        let set = matches!(self.operator, Operator::In | Operator::NotIn);
        if set {
            f.write_str("(")?;
        }
        // Values are kept sorted, which is what `safeSort` prints.
        f.write_str(&self.values.join(","))?;
        if set {
            f.write_str(")")?;
        }
        Ok(())
    }
}

/// A parsed label selector: the AND of its requirements, sorted by key.
///
/// The default value selects everything, like `labels.Everything()`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Hash)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

impl LabelSelector {
    /// Parses a `labelSelector` query value as `labels.Parse` does; `""` selects everything.
    ///
    /// # Errors
    ///
    /// [`SelectorError::Label`] with the apiserver's message for malformed syntax, invalid
    /// label keys or values, and non-integer `>` / `<` operands.
    pub fn parse(s: &str) -> Result<LabelSelector, SelectorError> {
        let mut parser = Parser::new(s);
        let mut requirements = parser.parse().map_err(SelectorError::Label)?;
        // sort.Sort(ByKey(items)); a stable sort keeps `String()` deterministic for repeated
        // keys (Go's insertion sort for short slices is stable too).
        requirements.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(LabelSelector { requirements })
    }

    /// Whether objects with these labels are selected; `labels(key)` returns the value of a
    /// label, or `None` if the object does not have it.
    pub fn matches<'a>(&self, labels: impl Fn(&str) -> Option<&'a str>) -> bool {
        self.requirements.iter().all(|r| r.matches(&labels))
    }

    /// Whether the selector selects everything (no requirements).
    pub fn is_everything(&self) -> bool {
        self.requirements.is_empty()
    }

    /// The requirements, sorted by key.
    pub fn requirements(&self) -> &[Requirement] {
        &self.requirements
    }

    /// The single value `key` must have (`key=v`, `key==v`, `key in (v)`), as
    /// `RequiresExactMatch` reports it: only the first requirement on `key` is consulted.
    pub fn exact_value(&self, key: &str) -> Option<&str> {
        let r = self.requirements.iter().find(|r| r.key == key)?;
        match (r.operator, r.values.as_slice()) {
            (Operator::Equals | Operator::DoubleEquals | Operator::In, [v]) => Some(v),
            _ => None,
        }
    }
}

impl fmt::Display for LabelSelector {
    /// `internalSelector.String()`: requirements joined by `,`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.requirements.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

/// Lexer tokens, as in `labels.Token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token {
    Error,
    EndOfString,
    ClosedPar,
    Comma,
    DoesNotExist,
    DoubleEquals,
    Equals,
    GreaterThan,
    Identifier,
    In,
    LessThan,
    NotEquals,
    NotIn,
    OpenPar,
}

/// `string2token`.
fn string_to_token(s: &[u8]) -> Option<Token> {
    Some(match s {
        b")" => Token::ClosedPar,
        b"," => Token::Comma,
        b"!" => Token::DoesNotExist,
        b"==" => Token::DoubleEquals,
        b"=" => Token::Equals,
        b">" => Token::GreaterThan,
        b"in" => Token::In,
        b"<" => Token::LessThan,
        b"!=" => Token::NotEquals,
        b"notin" => Token::NotIn,
        b"(" => Token::OpenPar,
        _ => return None,
    })
}

fn is_whitespace(ch: u8) -> bool {
    matches!(ch, b' ' | b'\t' | b'\r' | b'\n')
}

fn is_special_symbol(ch: u8) -> bool {
    matches!(ch, b'=' | b'!' | b'(' | b')' | b',' | b'>' | b'<')
}

/// The byte lexer of `labels.Lexer`. Like Go's, `read` returns 0 both at the end of input and
/// for a NUL byte, which therefore ends an identifier or, between tokens, the whole selector.
struct Lexer<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Lexer<'a> {
    fn read(&mut self) -> u8 {
        match self.s.as_bytes().get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                b
            }
            None => 0,
        }
    }

    fn unread(&mut self) {
        self.pos -= 1;
    }

    fn scan_id_or_keyword(&mut self) -> (Token, &'a str) {
        let start = self.pos;
        let end = loop {
            let ch = self.read();
            if ch == 0 {
                // End of input, or a NUL byte that was consumed and is not part of the literal.
                break if self.pos > start && self.s.as_bytes()[self.pos - 1] == 0 {
                    self.pos - 1
                } else {
                    self.pos
                };
            }
            if is_special_symbol(ch) || is_whitespace(ch) {
                self.unread();
                break self.pos;
            }
        };
        // Every delimiter is ASCII, so this is a char boundary.
        let lit = &self.s[start..end];
        match string_to_token(lit.as_bytes()) {
            Some(tok) => (tok, lit),
            None => (Token::Identifier, lit),
        }
    }

    fn scan_special_symbol(&mut self) -> (Token, Cow<'a, str>) {
        let start = self.pos;
        let mut last: Option<(Token, usize)> = None;
        let mut len = 0;
        loop {
            let ch = self.read();
            if ch == 0 {
                break;
            }
            if is_special_symbol(ch) {
                len += 1;
                let buffer = &self.s.as_bytes()[start..start + len];
                if let Some(tok) = string_to_token(buffer) {
                    last = Some((tok, len));
                } else if last.is_some() {
                    self.unread();
                    break;
                }
            } else {
                self.unread();
                break;
            }
        }
        match last {
            Some((tok, n)) => (tok, Cow::Borrowed(&self.s[start..start + n])),
            None => (
                Token::Error,
                Cow::Owned(format!(
                    "error expected: keyword found '{}'",
                    &self.s[start..start + len]
                )),
            ),
        }
    }

    fn lex(&mut self) -> (Token, Cow<'a, str>) {
        let mut ch = self.read();
        while is_whitespace(ch) {
            ch = self.read();
        }
        if ch == 0 {
            return (Token::EndOfString, Cow::Borrowed(""));
        }
        self.unread();
        if is_special_symbol(ch) {
            self.scan_special_symbol()
        } else {
            let (tok, lit) = self.scan_id_or_keyword();
            (tok, Cow::Borrowed(lit))
        }
    }
}

/// Whether `in` / `notin` are keywords (operator position) or plain identifiers (values).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Context {
    KeyAndOperator,
    Values,
}

/// The recursive descent parser of `labels.Parser`. Errors are the apiserver's strings.
struct Parser<'a> {
    items: Vec<(Token, Cow<'a, str>)>,
    position: usize,
}

/// `strings.Join(binaryOperators, ", ")`, with `selection.GreaterThan` = "gt" and
/// `selection.LessThan` = "lt".
const BINARY_OPERATORS: &str = "in, notin, =, ==, !=, gt, lt";

impl<'a> Parser<'a> {
    fn new(s: &'a str) -> Self {
        let mut lexer = Lexer { s, pos: 0 };
        let mut items = Vec::new();
        loop {
            let (tok, lit) = lexer.lex();
            items.push((tok, lit));
            if tok == Token::EndOfString {
                break;
            }
        }
        Parser { items, position: 0 }
    }

    fn map_context(tok: Token, ctx: Context) -> Token {
        match (ctx, tok) {
            (Context::Values, Token::In | Token::NotIn) => Token::Identifier,
            _ => tok,
        }
    }

    fn lookahead(&self, ctx: Context) -> (Token, String) {
        let (tok, lit) = &self.items[self.position.min(self.items.len() - 1)];
        (Self::map_context(*tok, ctx), lit.to_string())
    }

    fn consume(&mut self, ctx: Context) -> (Token, String) {
        // The parser never consumes past EndOfString: every caller stops at it.
        let (tok, lit) = &self.items[self.position.min(self.items.len() - 1)];
        self.position += 1;
        (Self::map_context(*tok, ctx), lit.to_string())
    }

    fn parse(&mut self) -> Result<Vec<Requirement>, String> {
        let mut requirements = Vec::new();
        loop {
            let (tok, lit) = self.lookahead(Context::Values);
            match tok {
                Token::Identifier | Token::DoesNotExist => {
                    let r = self
                        .parse_requirement()
                        .map_err(|e| format!("unable to parse requirement: {e}"))?;
                    requirements.push(r);
                    let (t, l) = self.consume(Context::Values);
                    match t {
                        Token::EndOfString => return Ok(requirements),
                        Token::Comma => {
                            let (t2, l2) = self.lookahead(Context::Values);
                            if t2 != Token::Identifier && t2 != Token::DoesNotExist {
                                return Err(format!(
                                    "found '{l2}', expected: identifier after ','"
                                ));
                            }
                        }
                        _ => {
                            return Err(format!("found '{l}', expected: ',' or 'end of string'"));
                        }
                    }
                }
                Token::EndOfString => return Ok(requirements),
                _ => {
                    return Err(format!(
                        "found '{lit}', expected: !, identifier, or 'end of string'"
                    ));
                }
            }
        }
    }

    fn parse_requirement(&mut self) -> Result<Requirement, String> {
        let (key, operator) = self.parse_key_and_infer_operator()?;
        if let Some(op @ (Operator::Exists | Operator::DoesNotExist)) = operator {
            return new_requirement(key, op, Vec::new());
        }
        let operator = self.parse_operator()?;
        let values = match operator {
            Operator::In | Operator::NotIn => self.parse_values()?,
            _ => self.parse_exact_value()?,
        };
        new_requirement(key, operator, values)
    }

    fn parse_key_and_infer_operator(&mut self) -> Result<(String, Option<Operator>), String> {
        let mut operator = None;
        let (mut tok, mut literal) = self.consume(Context::Values);
        if tok == Token::DoesNotExist {
            operator = Some(Operator::DoesNotExist);
            (tok, literal) = self.consume(Context::Values);
        }
        if tok != Token::Identifier {
            return Err(format!("found '{literal}', expected: identifier"));
        }
        // validateLabelKey(literal, p.path) with a nil path, which prints as "<nil>".
        let errs = label_key_errors(&literal);
        if !errs.is_empty() {
            return Err(field_invalid("<nil>", &literal, &errs.join("; ")));
        }
        let (t, _) = self.lookahead(Context::Values);
        if (t == Token::EndOfString || t == Token::Comma)
            && operator != Some(Operator::DoesNotExist)
        {
            operator = Some(Operator::Exists);
        }
        Ok((literal, operator))
    }

    fn parse_operator(&mut self) -> Result<Operator, String> {
        let (tok, lit) = self.consume(Context::KeyAndOperator);
        Ok(match tok {
            Token::In => Operator::In,
            Token::Equals => Operator::Equals,
            Token::DoubleEquals => Operator::DoubleEquals,
            Token::GreaterThan => Operator::GreaterThan,
            Token::LessThan => Operator::LessThan,
            Token::NotIn => Operator::NotIn,
            Token::NotEquals => Operator::NotEquals,
            _ => return Err(format!("found '{lit}', expected: {BINARY_OPERATORS}")),
        })
    }

    fn parse_values(&mut self) -> Result<Vec<String>, String> {
        let (tok, lit) = self.consume(Context::Values);
        if tok != Token::OpenPar {
            return Err(format!("found '{lit}' expected: '('"));
        }
        let (tok, lit) = self.lookahead(Context::Values);
        match tok {
            Token::Identifier | Token::Comma => {
                let s = self.parse_identifiers_list()?;
                let (tok, _) = self.consume(Context::Values);
                if tok != Token::ClosedPar {
                    // Go reports the literal seen before the list here.
                    return Err(format!("found '{lit}', expected: ')'"));
                }
                Ok(s)
            }
            Token::ClosedPar => {
                self.consume(Context::Values);
                Ok(vec![String::new()])
            }
            _ => Err(format!("found '{lit}', expected: ',', ')' or identifier")),
        }
    }

    fn parse_identifiers_list(&mut self) -> Result<Vec<String>, String> {
        let mut s: Vec<String> = Vec::new();
        loop {
            let (tok, lit) = self.consume(Context::Values);
            match tok {
                Token::Identifier => {
                    s.push(lit);
                    let (tok2, lit2) = self.lookahead(Context::Values);
                    match tok2 {
                        Token::Comma => continue,
                        Token::ClosedPar => return Ok(s),
                        _ => return Err(format!("found '{lit2}', expected: ',' or ')'")),
                    }
                }
                Token::Comma => {
                    if s.is_empty() {
                        s.push(String::new()); // "(,"
                    }
                    let (tok2, _) = self.lookahead(Context::Values);
                    if tok2 == Token::ClosedPar {
                        s.push(String::new()); // ",)"
                        return Ok(s);
                    }
                    if tok2 == Token::Comma {
                        self.consume(Context::Values);
                        s.push(String::new()); // ",,"
                    }
                }
                _ => return Err(format!("found '{lit}', expected: ',', or identifier")),
            }
        }
    }

    fn parse_exact_value(&mut self) -> Result<Vec<String>, String> {
        let (tok, _) = self.lookahead(Context::Values);
        if tok == Token::EndOfString || tok == Token::Comma {
            return Ok(vec![String::new()]);
        }
        let (tok, lit) = self.consume(Context::Values);
        if tok == Token::Identifier {
            return Ok(vec![lit]);
        }
        Err(format!("found '{lit}', expected: identifier"))
    }
}

/// `NewRequirement(key, op, sets.String(values).List())` for a key already validated by the
/// parser: values become a sorted set, then get checked; errors aggregate like
/// `field.ErrorList.ToAggregate()`.
fn new_requirement(
    key: String,
    operator: Operator,
    mut values: Vec<String>,
) -> Result<Requirement, String> {
    values.sort();
    values.dedup();
    let mut errs: Vec<String> = Vec::new();
    if matches!(operator, Operator::GreaterThan | Operator::LessThan) {
        // The parser always yields exactly one value here.
        for (i, v) in values.iter().enumerate() {
            if v.parse::<i64>().is_err() {
                errs.push(field_invalid(
                    &format!("values[{i}]"),
                    v,
                    "for 'Gt', 'Lt' operators, the value must be an integer",
                ));
            }
        }
    }
    for (i, v) in values.iter().enumerate() {
        let msgs = label_value_errors(v);
        if !msgs.is_empty() {
            errs.push(field_invalid(
                &format!("values[{i}][{key}]"),
                v,
                &msgs.join("; "),
            ));
        }
    }
    errs.dedup();
    match errs.len() {
        0 => Ok(Requirement {
            key,
            operator,
            values,
        }),
        1 => Err(errs.remove(0)),
        _ => {
            let mut seen: Vec<&String> = Vec::new();
            for e in &errs {
                if !seen.contains(&e) {
                    seen.push(e);
                }
            }
            let joined: Vec<&str> = seen.iter().map(|s| s.as_str()).collect();
            Err(format!("[{}]", joined.join(", ")))
        }
    }
}

/// `field.Invalid(path, value, detail).Error()` for a string value.
fn field_invalid(path: &str, value: &str, detail: &str) -> String {
    format!("{path}: Invalid value: {}: {detail}", go_quote(value))
}

/// Go's `%q` (`strconv.Quote`) for the strings that can reach an error message. Printability
/// approximates `unicode.IsPrint`: controls, non-ASCII spaces and common format characters
/// are escaped.
fn go_quote(s: &str) -> String {
    use fmt::Write as _;
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\x07' => out.push_str("\\a"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x0b' => out.push_str("\\v"),
            c if is_go_printable(c) => out.push(c),
            c if (c as u32) < 0x80 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push('"');
    out
}

fn is_go_printable(c: char) -> bool {
    if c == ' ' {
        return true;
    }
    !c.is_control()
        && !c.is_whitespace()
        && !matches!(c, '\u{ad}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2064}' | '\u{feff}')
}

const LABEL_KEY_FMT: &str = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]";
const LABEL_KEY_ERR_MSG: &str = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";
const LABEL_VALUE_FMT: &str = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?";
const LABEL_VALUE_ERR_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";
const DNS1123_SUBDOMAIN_FMT: &str =
    "[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*";
const DNS1123_SUBDOMAIN_ERR_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character";
/// `content.labelKeyMaxLength` and `content.LabelValueMaxLength`.
const LABEL_MAX_LEN: usize = 63;
/// `content.DNS1123SubdomainMaxLength`.
const DNS1123_SUBDOMAIN_MAX_LEN: usize = 253;

/// `content.RegexError`.
fn regex_error(msg: &str, re: &str, examples: &[&str]) -> String {
    let mut out = String::from(msg);
    if examples.is_empty() {
        out.push_str(" (regex used for validation is '");
    } else {
        out.push_str(" (e.g. ");
        for (i, e) in examples.iter().enumerate() {
            if i > 0 {
                out.push_str(" or ");
            }
            out.push('\'');
            out.push_str(e);
            out.push_str("', ");
        }
        out.push_str("regex used for validation is '");
    }
    out.push_str(re);
    out.push_str("')");
    out
}

/// `content.MaxLenError`.
fn max_len_error(n: usize) -> String {
    format!("must be no more than {n} bytes")
}

/// `^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$`
fn is_qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(f), Some(l)) => {
            f.is_ascii_alphanumeric()
                && l.is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// `^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
fn is_dns1123_subdomain(s: &str) -> bool {
    s.split('.').all(|label| {
        let b = label.as_bytes();
        let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        match (b.first(), b.last()) {
            (Some(f), Some(l)) => alnum(f) && alnum(l) && b.iter().all(|c| alnum(c) || *c == b'-'),
            _ => false,
        }
    })
}

/// `content.IsLabelKey` (a.k.a. `validation.IsQualifiedName`).
fn label_key_errors(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    let parts: Vec<&str> = value.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_string());
            } else {
                if prefix.len() > DNS1123_SUBDOMAIN_MAX_LEN {
                    errs.push(format!(
                        "prefix part {}",
                        max_len_error(DNS1123_SUBDOMAIN_MAX_LEN)
                    ));
                }
                if !is_dns1123_subdomain(prefix) {
                    errs.push(format!(
                        "prefix part {}",
                        regex_error(
                            DNS1123_SUBDOMAIN_ERR_MSG,
                            DNS1123_SUBDOMAIN_FMT,
                            &["example.com"]
                        )
                    ));
                }
            }
            *name
        }
        _ => {
            errs.push(format!(
                "a valid label key {} with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')",
                regex_error(LABEL_KEY_ERR_MSG, LABEL_KEY_FMT, &["MyName", "my.name", "123-abc"])
            ));
            return errs;
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_string());
    } else if name.len() > LABEL_MAX_LEN {
        errs.push(format!("name part {}", max_len_error(LABEL_MAX_LEN)));
    }
    if !is_qualified_name_part(name) {
        errs.push(format!(
            "name part {}",
            regex_error(
                LABEL_KEY_ERR_MSG,
                LABEL_KEY_FMT,
                &["MyName", "my.name", "123-abc"]
            )
        ));
    }
    errs
}

/// `content.IsLabelValue`.
fn label_value_errors(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if value.len() > LABEL_MAX_LEN {
        errs.push(max_len_error(LABEL_MAX_LEN));
    }
    if !value.is_empty() && !is_qualified_name_part(value) {
        errs.push(regex_error(
            LABEL_VALUE_ERR_MSG,
            LABEL_VALUE_FMT,
            &["MyValue", "my_value", "12345"],
        ));
    }
    errs
}

// ---------------------------------------------------------------------------------------------
// Field selectors
// ---------------------------------------------------------------------------------------------

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
    /// everything. Field names are not checked here: see [`check_field_selector`].
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

    fn from_terms(mut terms: Vec<FieldTerm>) -> FieldSelector {
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

// ---------------------------------------------------------------------------------------------
// Per-kind field support
// ---------------------------------------------------------------------------------------------

/// How the apiserver rejects a field label for a kind (its conversion func's `fmt.Errorf`).
#[derive(Clone, Copy)]
enum Reject {
    /// `field label not supported: %s` (core/v1 kinds, certificates/v1).
    NotSupported,
    /// `field label %q not supported for Job` (batch/v1).
    NotSupportedForJob,
}

/// A kind whose field label conversion function was read from the Kubernetes source.
struct KindFields {
    group: &'static str,
    resource: &'static str,
    /// Every label the conversion func accepts, as the apiserver stores it after conversion.
    accepted: &'static [&'static str],
    /// Labels the conversion func renames: (sent by the client, evaluated as).
    aliases: &'static [(&'static str, &'static str)],
    /// The selectable fields beyond `metadata.name` / `metadata.namespace`.
    extra: &'static [&'static str],
    reject: Reject,
}

const POD_EXTRA: &[&str] = &[
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.podIPs",
    "status.nominatedNodeName",
];
const EVENT_EXTRA: &[&str] = &[
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
];

/// The kinds modelled exactly. Sources: `pkg/apis/core/v1/conversion.go`
/// (`addConversionFuncs`, `AddFieldLabelConversionsFor{Event,Namespace,Secret,Service}`),
/// `pkg/apis/batch/v1/conversion.go`, `pkg/apis/certificates/v1/conversion.go`.
const KINDS: &[KindFields] = &[
    KindFields {
        group: "",
        resource: "pods",
        accepted: &[
            "metadata.name",
            "metadata.namespace",
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.podIPs",
            "status.nominatedNodeName",
        ],
        // "for backwards compatibility with old v1 clients which send spec.host"
        aliases: &[("spec.host", "spec.nodeName")],
        extra: POD_EXTRA,
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "nodes",
        // No metadata.namespace: the Node conversion func rejects it.
        accepted: &["metadata.name", "spec.unschedulable"],
        aliases: &[],
        extra: &["spec.unschedulable"],
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "replicationcontrollers",
        accepted: &["metadata.name", "metadata.namespace", "status.replicas"],
        aliases: &[],
        extra: &["status.replicas"],
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "events",
        accepted: &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
            "metadata.namespace",
            "metadata.name",
        ],
        aliases: &[],
        extra: EVENT_EXTRA,
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "namespaces",
        // No metadata.namespace: the Namespace conversion func rejects it.
        accepted: &["status.phase", "metadata.name"],
        aliases: &[],
        extra: &["status.phase"],
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "secrets",
        accepted: &["type", "metadata.namespace", "metadata.name"],
        aliases: &[],
        extra: &["type"],
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "services",
        accepted: &[
            "metadata.namespace",
            "metadata.name",
            "spec.clusterIP",
            "spec.type",
        ],
        aliases: &[],
        extra: &["spec.clusterIP", "spec.type"],
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "batch",
        resource: "jobs",
        accepted: &["metadata.name", "metadata.namespace", "status.successful"],
        aliases: &[],
        extra: &["status.successful"],
        reject: Reject::NotSupportedForJob,
    },
    KindFields {
        group: "certificates.k8s.io",
        resource: "certificatesigningrequests",
        accepted: &["metadata.name", "spec.signerName"],
        aliases: &[],
        extra: &["spec.signerName"],
        reject: Reject::NotSupported,
    },
];

/// Kinds with a conversion func the proxy does not model (its list or messages vary between
/// releases): any selector on them beyond the empty one goes to the apiserver.
const UNMODELLED: &[(&str, &str)] = &[
    // Accepts regarding.*, reportingController, ... mapped onto the core Event field set in
    // recent releases; the mapping is not in every version the proxy may front.
    ("events.k8s.io", "events"),
    ("certificates.k8s.io", "clustertrustbundles"),
    ("certificates.k8s.io", "podcertificaterequests"),
    ("resource.k8s.io", "resourceslices"),
    ("resource.k8s.io", "resourceclaims"),
    ("coordination.k8s.io", "leasecandidates"),
];

fn kind(group: &str, resource: &str) -> Option<&'static KindFields> {
    KINDS
        .iter()
        .find(|k| k.group == group && k.resource == resource)
}

/// Which field selectors kube-apiserver supports for a resource (group, resource), beyond
/// `metadata.name` and `metadata.namespace`; empty means "only the generic two" (or, for the
/// kinds [`check_field_selector`] passes through, "not modelled").
///
/// Note `nodes`, `namespaces` and `certificatesigningrequests` accept `metadata.name` but not
/// `metadata.namespace`, and pods also accept `spec.host` as an alias of `spec.nodeName`;
/// [`check_field_selector`] applies both rules.
pub fn supported_fields(group: &str, resource: &str) -> &'static [&'static str] {
    kind(group, resource).map_or(&[], |k| k.extra)
}

/// The name of a selectable field held with a cached object
/// ([`crate::cache::object::Meta::fields`]): a built-in kind's, or a custom resource's label,
/// shared by all its objects (an object holds a pointer, not a copy of the name).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FieldName {
    Builtin(&'static str),
    Custom(Arc<str>),
}

impl FieldName {
    pub fn as_str(&self) -> &str {
        match self {
            FieldName::Builtin(s) => s,
            FieldName::Custom(s) => s,
        }
    }
}

/// One of a custom resource's selectable fields.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CustomField {
    /// The field label: the jsonPath without its leading dot (`spec.color`), as the apiserver
    /// names it (`strings.TrimPrefix(sf.JSONPath, ".")`).
    label: Arc<str>,
}

impl CustomField {
    pub fn label(&self) -> &str {
        &self.label
    }

    fn segments(&self) -> std::str::Split<'_, char> {
        self.label.split('.')
    }

    /// The number of segments of the path.
    fn depth(&self) -> usize {
        self.label.bytes().filter(|b| *b == b'.').count() + 1
    }
}

/// The field selectors a CustomResourceDefinition version accepts besides `metadata.name` and
/// (namespaced) `metadata.namespace`: its `selectableFields` (Kubernetes 1.31+, GA in 1.32,
/// KEP-4358), each a JSONPath evaluated against every object of that version.
///
/// The proxy evaluates paths of the form `.a.b.c` (names of letters, digits, `-` and `_`),
/// which is what CRD validation allows (no array notation, properties of the schema) for all
/// but exotic property names. If any declared path has another form, nothing is evaluated and
/// field selectors beyond metadata pass through to the apiserver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CustomFields {
    fields: Arc<[CustomField]>,
    /// A declared path the proxy does not evaluate.
    opaque: bool,
}

/// The most fields the scan tracks (one bit each); CRD validation allows 8 per version.
const MAX_CUSTOM_FIELDS: usize = 64;

impl CustomFields {
    /// From a CRD version's `selectableFields[].jsonPath`, in the CRD's order.
    pub fn from_json_paths<'p>(paths: impl IntoIterator<Item = &'p str>) -> CustomFields {
        let mut fields = Vec::new();
        for p in paths {
            let simple = p.strip_prefix('.').filter(|label| {
                label.split('.').all(|seg| {
                    !seg.is_empty()
                        && seg
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                })
            });
            match simple {
                // Validation rejects duplicates; a second copy would add nothing.
                Some(label) if !fields.iter().any(|f: &CustomField| &*f.label == label) => fields
                    .push(CustomField {
                        label: label.into(),
                    }),
                Some(_) => {}
                None => {
                    return CustomFields {
                        fields: Arc::new([]),
                        opaque: true,
                    };
                }
            }
        }
        if fields.len() > MAX_CUSTOM_FIELDS {
            return CustomFields {
                fields: Arc::new([]),
                opaque: true,
            };
        }
        CustomFields {
            fields: fields.into(),
            opaque: false,
        }
    }

    /// Whether no field is declared.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty() && !self.opaque
    }

    /// Whether some declared path is one the proxy does not evaluate.
    pub fn is_opaque(&self) -> bool {
        self.opaque
    }

    /// The fields the cache evaluates (none when [`CustomFields::is_opaque`]).
    pub fn evaluated(&self) -> &[CustomField] {
        &self.fields
    }

    /// The field labels, in the CRD's order.
    pub fn labels(&self) -> impl Iterator<Item = &str> {
        self.fields.iter().map(CustomField::label)
    }
}

/// What the apiserver would do with a field selector on a resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldCheck {
    /// Every field is supported: evaluate this selector (aliases such as pods' `spec.host`
    /// already rewritten) against the fields the cache extracted at ingest ([`FieldScan`]).
    Cache(FieldSelector),
    /// The apiserver answers 400 `BadRequest` with this message.
    Reject(SelectorError),
    /// The proxy cannot be sure what the apiserver does: send the request upstream.
    Passthrough,
}

/// Applies the apiserver's field label conversion for a resource to a parsed selector: the
/// step `ListResource` runs before storage sees the selector.
///
/// Terms are checked in the apiserver's order (sorted), so the first unsupported field named
/// in a rejection is the one the apiserver names. Built-in kinds without a modelled conversion
/// func are cached only for `metadata.name` / `metadata.namespace` (the default conversion);
/// any other field passes through. Custom resources follow [`check_custom_field_selector`].
pub fn check_field_selector(resource: &Resource, selector: &FieldSelector) -> FieldCheck {
    if resource.custom {
        return check_custom_field_selector(resource.namespaced, &resource.selectable, selector);
    }
    check_builtin_field_selector(&resource.group, &resource.resource, selector)
}

/// The field label conversion of a custom resource (`crConverter.ConvertFieldLabel` in
/// apiextensions-apiserver `pkg/apiserver/conversion/converter.go`): `metadata.name`,
/// `metadata.namespace` when namespaced, and the version's selectable fields; anything else
/// is `field label not supported: <label>`.
pub fn check_custom_field_selector(
    namespaced: bool,
    fields: &CustomFields,
    selector: &FieldSelector,
) -> FieldCheck {
    for t in &selector.terms {
        let f = t.field.as_str();
        let ok = f == "metadata.name"
            || (namespaced && f == "metadata.namespace")
            || fields.labels().any(|l| l == f);
        if !ok {
            // A declared path the proxy does not evaluate may be this label.
            if fields.is_opaque() {
                return FieldCheck::Passthrough;
            }
            return FieldCheck::Reject(SelectorError::UnsupportedField(format!(
                "field label not supported: {f}"
            )));
        }
    }
    FieldCheck::Cache(selector.clone())
}

/// [`check_field_selector`] for a built-in (or aggregated) resource.
pub fn check_builtin_field_selector(
    group: &str,
    resource: &str,
    selector: &FieldSelector,
) -> FieldCheck {
    if selector.is_everything() {
        return FieldCheck::Cache(selector.clone());
    }
    if UNMODELLED.contains(&(group, resource)) {
        return FieldCheck::Passthrough;
    }
    let Some(k) = kind(group, resource) else {
        let generic = selector
            .fields()
            .all(|f| f == "metadata.name" || f == "metadata.namespace");
        return if generic {
            FieldCheck::Cache(selector.clone())
        } else {
            FieldCheck::Passthrough
        };
    };
    let mut terms = Vec::with_capacity(selector.terms.len());
    for t in &selector.terms {
        let field = if let Some((_, to)) = k.aliases.iter().find(|(from, _)| *from == t.field) {
            *to
        } else if let Some(f) = k.accepted.iter().find(|f| **f == t.field) {
            *f
        } else {
            let msg = match k.reject {
                Reject::NotSupported => format!("field label not supported: {}", t.field),
                Reject::NotSupportedForJob => {
                    format!("field label {} not supported for Job", go_quote(&t.field))
                }
            };
            return FieldCheck::Reject(SelectorError::UnsupportedField(msg));
        };
        terms.push(FieldTerm {
            field: field.to_string(),
            value: t.value.clone(),
            equal: t.equal,
        });
    }
    FieldCheck::Cache(FieldSelector::from_terms(terms))
}

/// A JSON string that borrows from the input when it has no escapes; `null` and absence read
/// as `""`, the zero value the Go structs would hold.
#[derive(Default)]
struct JStr<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for JStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = JStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or null")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(JStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(JStr(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(JStr(Cow::Owned(v)))
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(JStr::default())
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(JStr::default())
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_str(V)
            }
        }
        d.deserialize_option(V)
    }
}

impl JStr<'_> {
    fn get(&self) -> String {
        self.0.to_string()
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Meta<'a> {
    #[serde(borrow)]
    name: JStr<'a>,
    #[serde(borrow)]
    namespace: JStr<'a>,
}

/// Only `metadata`; everything else is skipped without building values.
#[derive(Deserialize)]
struct MetaOnly<'a> {
    #[serde(borrow, default)]
    metadata: Option<Meta<'a>>,
}

/// The union of the paths the modelled kinds select on; each kind reads its own.
#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Selectable<'a> {
    #[serde(borrow)]
    metadata: Option<Meta<'a>>,
    #[serde(borrow)]
    spec: Option<Spec<'a>>,
    #[serde(borrow)]
    status: Option<Status<'a>>,
    /// Secret and Event `type`.
    #[serde(borrow, rename = "type")]
    type_: JStr<'a>,
    #[serde(borrow)]
    involved_object: Option<ObjectRef<'a>>,
    #[serde(borrow)]
    reason: JStr<'a>,
    #[serde(borrow)]
    reporting_component: JStr<'a>,
    #[serde(borrow)]
    source: Option<EventSource<'a>>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Spec<'a> {
    #[serde(borrow)]
    node_name: JStr<'a>,
    #[serde(borrow)]
    restart_policy: JStr<'a>,
    #[serde(borrow)]
    scheduler_name: JStr<'a>,
    #[serde(borrow)]
    service_account_name: JStr<'a>,
    /// Deprecated alias of `serviceAccountName`, honoured by the v1 → internal conversion.
    #[serde(borrow, rename = "serviceAccount")]
    deprecated_service_account: JStr<'a>,
    host_network: Option<bool>,
    unschedulable: Option<bool>,
    #[serde(borrow, rename = "clusterIP")]
    cluster_ip: JStr<'a>,
    #[serde(borrow, rename = "type")]
    type_: JStr<'a>,
    #[serde(borrow)]
    signer_name: JStr<'a>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Status<'a> {
    #[serde(borrow)]
    phase: JStr<'a>,
    #[serde(borrow, rename = "podIP")]
    pod_ip: JStr<'a>,
    #[serde(borrow, rename = "podIPs")]
    pod_ips: Option<Vec<PodIp<'a>>>,
    #[serde(borrow)]
    nominated_node_name: JStr<'a>,
    replicas: Option<i64>,
    succeeded: Option<i64>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct PodIp<'a> {
    #[serde(borrow)]
    ip: JStr<'a>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct ObjectRef<'a> {
    #[serde(borrow)]
    kind: JStr<'a>,
    #[serde(borrow)]
    namespace: JStr<'a>,
    #[serde(borrow)]
    name: JStr<'a>,
    #[serde(borrow)]
    uid: JStr<'a>,
    #[serde(borrow)]
    api_version: JStr<'a>,
    #[serde(borrow)]
    resource_version: JStr<'a>,
    #[serde(borrow)]
    field_path: JStr<'a>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct EventSource<'a> {
    #[serde(borrow)]
    component: JStr<'a>,
}

/// Values of the selectable fields of an object of a built-in kind, from its raw JSON, as the
/// registry's `GetAttrs` computes them (custom resources' are read by [`FieldScan`] only): `metadata.name`, `metadata.namespace` (`""` for cluster-scoped
/// objects) and the kind's [`supported_fields`]. Look fields up by the names that
/// [`check_field_selector`] returns (aliases already rewritten).
///
/// Formatting follows the Go code: booleans are `strconv.FormatBool` (`"true"`/`"false"`,
/// absent is `"false"`), counts are `strconv.Itoa` (absent is `"0"`), absent strings are `""`.
///
/// # Errors
///
/// When `raw` is not JSON or a selected path has an unexpected type.
pub fn extract_fields(
    group: &str,
    resource: &str,
    raw: &[u8],
) -> Result<Vec<(&'static str, String)>, serde_json::Error> {
    let Some(k) = kind(group, resource) else {
        let obj: MetaOnly<'_> = serde_json::from_slice(raw)?;
        let meta = obj.metadata.unwrap_or_default();
        return Ok(vec![
            ("metadata.name", meta.name.get()),
            ("metadata.namespace", meta.namespace.get()),
        ]);
    };
    let obj: Selectable<'_> = serde_json::from_slice(raw)?;
    Ok(fields_of(k, obj))
}

/// Collects an object's selectable fields during the cache's single pass over its JSON
/// ([`crate::k8s::scan`]): the same values as [`extract_fields`] for built-in kinds, and a
/// custom resource's declared [`CustomFields`], without a second parse.
pub struct FieldScan<'a, 'r> {
    kind: Option<&'static KindFields>,
    /// Top-level members the kind's fields read, besides `metadata`.
    wanted: &'static [&'static str],
    obj: Selectable<'a>,
    custom: Option<CustomScan<'r>>,
}

/// The values of a custom resource's selectable fields found so far, by field index.
struct CustomScan<'r> {
    fields: &'r [CustomField],
    values: Vec<Option<Box<str>>>,
}

impl CustomScan<'_> {
    /// The fields whose path starts with the top-level member `key`, as a bit set.
    fn first_segment_mask(&self, key: &str) -> u64 {
        segment_mask(self.fields, 0, u64::MAX, key)
    }
}

impl<'a, 'r> FieldScan<'a, 'r> {
    pub fn new(resource: &'r Resource) -> FieldScan<'a, 'r> {
        if resource.custom {
            let fields = resource.selectable.evaluated();
            return FieldScan {
                kind: None,
                wanted: &[],
                obj: Selectable::default(),
                custom: (!fields.is_empty()).then(|| CustomScan {
                    fields,
                    values: vec![None; fields.len()],
                }),
            };
        }
        let kind = kind(&resource.group, &resource.resource);
        let wanted: &'static [&'static str] = match kind.map(|k| (k.group, k.resource)) {
            Some(("", "pods")) => &["spec", "status"],
            Some(("", "nodes" | "services")) | Some(("certificates.k8s.io", _)) => &["spec"],
            Some(("", "replicationcontrollers" | "namespaces")) | Some(("batch", "jobs")) => {
                &["status"]
            }
            Some(("", "secrets")) => &["type"],
            Some(("", "events")) => &[
                "involvedObject",
                "reason",
                "reportingComponent",
                "source",
                "type",
            ],
            _ => &[],
        };
        FieldScan {
            kind,
            wanted,
            obj: Selectable::default(),
            custom: None,
        }
    }

    /// Whether the top-level member `key` is read by [`FieldScan::member`].
    pub fn wants(&self, key: &str) -> bool {
        match &self.custom {
            Some(c) => c.first_segment_mask(key) != 0,
            None => self.wanted.contains(&key),
        }
    }

    /// Reads the top-level member `key` (one [`FieldScan::wants`]) at the cursor.
    pub fn member(&mut self, key: &str, s: &mut Scanner<'a>) -> Result<(), ScanError> {
        if let Some(c) = &mut self.custom {
            let mask = c.first_segment_mask(key);
            return custom_value(s, c.fields, &mut c.values, 1, mask);
        }
        let o = &mut self.obj;
        match key {
            "spec" => {
                let spec = o.spec.get_or_insert_default();
                s.object(|s, k| {
                    match &*k {
                        "nodeName" => spec.node_name = jstr(s)?,
                        "restartPolicy" => spec.restart_policy = jstr(s)?,
                        "schedulerName" => spec.scheduler_name = jstr(s)?,
                        "serviceAccountName" => spec.service_account_name = jstr(s)?,
                        "serviceAccount" => spec.deprecated_service_account = jstr(s)?,
                        "hostNetwork" => spec.host_network = jbool(s)?,
                        "unschedulable" => spec.unschedulable = jbool(s)?,
                        "clusterIP" => spec.cluster_ip = jstr(s)?,
                        "type" => spec.type_ = jstr(s)?,
                        "signerName" => spec.signer_name = jstr(s)?,
                        _ => s.skip()?,
                    }
                    Ok(())
                })
            }
            "status" => {
                let st = o.status.get_or_insert_default();
                s.object(|s, k| {
                    match &*k {
                        "phase" => st.phase = jstr(s)?,
                        "podIP" => st.pod_ip = jstr(s)?,
                        "podIPs" => {
                            let mut ips = Vec::new();
                            s.array(|s, _| {
                                let mut ip = PodIp::default();
                                s.object(|s, k| {
                                    if k == "ip" {
                                        ip.ip = jstr(s)?;
                                    } else {
                                        s.skip()?;
                                    }
                                    Ok(())
                                })?;
                                ips.push(ip);
                                Ok(())
                            })?;
                            st.pod_ips = Some(ips);
                        }
                        "nominatedNodeName" => st.nominated_node_name = jstr(s)?,
                        "replicas" => st.replicas = jint(s)?,
                        "succeeded" => st.succeeded = jint(s)?,
                        _ => s.skip()?,
                    }
                    Ok(())
                })
            }
            "involvedObject" => {
                let io = o.involved_object.get_or_insert_default();
                s.object(|s, k| {
                    match &*k {
                        "kind" => io.kind = jstr(s)?,
                        "namespace" => io.namespace = jstr(s)?,
                        "name" => io.name = jstr(s)?,
                        "uid" => io.uid = jstr(s)?,
                        "apiVersion" => io.api_version = jstr(s)?,
                        "resourceVersion" => io.resource_version = jstr(s)?,
                        "fieldPath" => io.field_path = jstr(s)?,
                        _ => s.skip()?,
                    }
                    Ok(())
                })
            }
            "source" => {
                let src = o.source.get_or_insert_default();
                s.object(|s, k| {
                    if k == "component" {
                        src.component = jstr(s)?;
                    } else {
                        s.skip()?;
                    }
                    Ok(())
                })
            }
            "reason" => jstr(s).map(|v| o.reason = v),
            "reportingComponent" => jstr(s).map(|v| o.reporting_component = v),
            "type" => jstr(s).map(|v| o.type_ = v),
            _ => s.skip(),
        }
    }

    /// The fields beyond `metadata.name` / `metadata.namespace` (which the cache reads from
    /// the object's metadata), given the object's metadata name and namespace.
    pub fn finish(mut self, name: &str, namespace: &str) -> Vec<(FieldName, Box<str>)> {
        if let Some(c) = self.custom {
            // An absent field, or one that is null, is "" (`selectableFields` in the CR
            // strategy sets "" when the JSONPath finds nothing or a nil value).
            return c
                .fields
                .iter()
                .zip(c.values)
                .map(|(f, v)| (FieldName::Custom(f.label.clone()), v.unwrap_or_default()))
                .collect();
        }
        let Some(k) = self.kind else {
            return Vec::new();
        };
        self.obj.metadata = Some(Meta {
            name: JStr(Cow::Owned(name.to_string())),
            namespace: JStr(Cow::Owned(namespace.to_string())),
        });
        fields_of(k, self.obj)
            .into_iter()
            .skip(2)
            .map(|(f, v)| (FieldName::Builtin(f), v.into_boxed_str()))
            .collect()
    }
}

/// The fields of `mask` whose path segment `depth` is `key`.
fn segment_mask(fields: &[CustomField], depth: usize, mask: u64, key: &str) -> u64 {
    let mut m = 0;
    for (i, f) in fields.iter().enumerate() {
        if mask & (1 << i) != 0 && f.segments().nth(depth) == Some(key) {
            m |= 1 << i;
        }
    }
    m
}

/// Reads the value at the cursor, reached by path segment `depth - 1` of the fields in
/// `mask`: the value of those whose path ends there, the members of an object for those
/// whose path goes on. Anything else on the way (a scalar where a path goes on, an array)
/// leaves the field absent, as the apiserver's JSONPath lookup with missing keys allowed
/// finds nothing there.
fn custom_value(
    s: &mut Scanner<'_>,
    fields: &[CustomField],
    values: &mut [Option<Box<str>>],
    depth: usize,
    mask: u64,
) -> Result<(), ScanError> {
    if mask == 0 {
        return s.skip();
    }
    let mut ends = 0;
    for (i, f) in fields.iter().enumerate() {
        if mask & (1 << i) != 0 && f.depth() == depth {
            ends |= 1 << i;
        }
    }
    let goes_on = mask & !ends;
    match s.peek()? {
        b'{' if goes_on != 0 => s.object(|s, k| {
            let m = segment_mask(fields, depth, goes_on, &k);
            custom_value(s, fields, values, depth + 1, m)
        }),
        // CRD validation only lets a selectable field point at a string, boolean or integer
        // in the schema, which the apiserver enforces on every write: an object or array
        // where a path ends is never stored.
        b'{' | b'[' => s.skip(),
        _ if ends == 0 => s.skip(),
        _ => {
            let v = go_sprint(s.scalar()?, s.pos())?;
            for (i, slot) in values.iter_mut().enumerate() {
                if ends & (1 << i) != 0 {
                    *slot = v.clone();
                }
            }
            Ok(())
        }
    }
}

/// `fmt.Sprint` of a JSON scalar as the apiserver's unstructured decoding holds it (integers
/// that fit as int64, other numbers as float64); `None` for null.
fn go_sprint(v: Scalar<'_>, at: usize) -> Result<Option<Box<str>>, ScanError> {
    Ok(Some(match v {
        Scalar::Null => return Ok(None),
        Scalar::Bool(b) => if b { "true" } else { "false" }.into(),
        Scalar::Str(s) => s.into(),
        // strconv.ParseInt(s, 10, 64), as `convertNumber` tries first: the same inputs as
        // i64::from_str for JSON numbers ("-0" is 0).
        Scalar::Num(n) => match n.parse::<i64>() {
            Ok(i) => i.to_string().into(),
            Err(_) => {
                let f: f64 = n.parse().map_err(|_| ScanError::Type {
                    at,
                    want: "a number",
                })?;
                go_format_float(f).into()
            }
        },
    }))
}

/// `fmt.Sprint(float64)`: `strconv.FormatFloat(f, 'g', -1, 64)`, the shortest digits that
/// round-trip, in `%e` form when the exponent is below -4 or at least 6 (the precision Go
/// uses for that decision with shortest formatting), with at least two exponent digits.
fn go_format_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "+Inf" } else { "-Inf" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip form too: `-1.2345e-7`, `0e0`.
    let e = format!("{f:e}");
    let (mantissa, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::with_capacity(digits.len() + 8);
    if neg {
        out.push('-');
    }
    if !(-4..6).contains(&exp) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exp.unsigned_abs()));
    } else if exp < 0 {
        out.push_str("0.");
        for _ in 0..(-exp - 1) {
            out.push('0');
        }
        out.push_str(&digits);
    } else {
        let int_len = exp as usize + 1;
        if digits.len() <= int_len {
            out.push_str(&digits);
            for _ in digits.len()..int_len {
                out.push('0');
            }
        } else {
            out.push_str(&digits[..int_len]);
            out.push('.');
            out.push_str(&digits[int_len..]);
        }
    }
    out
}

fn jstr<'a>(s: &mut Scanner<'a>) -> Result<JStr<'a>, ScanError> {
    Ok(JStr(s.opt_string()?.unwrap_or_default()))
}

fn jbool(s: &mut Scanner<'_>) -> Result<Option<bool>, ScanError> {
    let at = s.pos();
    match s.scalar()? {
        Scalar::Null => Ok(None),
        Scalar::Bool(b) => Ok(Some(b)),
        _ => Err(ScanError::Type { at, want: "a bool" }),
    }
}

fn jint(s: &mut Scanner<'_>) -> Result<Option<i64>, ScanError> {
    let at = s.pos();
    match s.scalar()? {
        Scalar::Null => Ok(None),
        Scalar::Num(n) => n.parse().map(Some).map_err(|_| ScanError::Type {
            at,
            want: "an integer",
        }),
        _ => Err(ScanError::Type {
            at,
            want: "an integer",
        }),
    }
}

/// The selectable fields of a decoded object of kind `k`.
fn fields_of(k: &KindFields, obj: Selectable<'_>) -> Vec<(&'static str, String)> {
    let meta = obj.metadata.unwrap_or_default();
    let spec = obj.spec.unwrap_or_default();
    let status = obj.status.unwrap_or_default();
    let mut out = Vec::with_capacity(2 + k.extra.len());
    out.push(("metadata.name", meta.name.get()));
    out.push(("metadata.namespace", meta.namespace.get()));
    let bool_str = |b: Option<bool>| if b.unwrap_or(false) { "true" } else { "false" };
    match (k.group, k.resource) {
        ("", "pods") => {
            out.push(("spec.nodeName", spec.node_name.get()));
            out.push(("spec.restartPolicy", spec.restart_policy.get()));
            out.push(("spec.schedulerName", spec.scheduler_name.get()));
            // Convert_v1_PodSpec_To_core_PodSpec: serviceAccount stands in when
            // serviceAccountName is empty.
            let sa = if spec.service_account_name.0.is_empty() {
                spec.deprecated_service_account.get()
            } else {
                spec.service_account_name.get()
            };
            out.push(("spec.serviceAccountName", sa));
            out.push(("spec.hostNetwork", bool_str(spec.host_network).to_string()));
            out.push(("status.phase", status.phase.get()));
            // Convert_v1_PodStatus_To_core_PodStatus makes podIP authoritative, else podIPs[0];
            // ToSelectableFields then reads the internal podIPs[0].
            let pod_ip = if status.pod_ip.0.is_empty() {
                status
                    .pod_ips
                    .as_deref()
                    .and_then(|ips| ips.first())
                    .map(|ip| ip.ip.get())
                    .unwrap_or_default()
            } else {
                status.pod_ip.get()
            };
            out.push(("status.podIP", pod_ip));
            // Accepted by the conversion func but never set by ToSelectableFields, so the
            // apiserver always sees "".
            out.push(("status.podIPs", String::new()));
            out.push(("status.nominatedNodeName", status.nominated_node_name.get()));
        }
        ("", "nodes") => {
            out.push((
                "spec.unschedulable",
                bool_str(spec.unschedulable).to_string(),
            ));
        }
        ("", "replicationcontrollers") => {
            out.push(("status.replicas", status.replicas.unwrap_or(0).to_string()));
        }
        ("", "events") => {
            let io = obj.involved_object.unwrap_or_default();
            let reporting = obj.reporting_component.get();
            // EventToSelectableFields: source falls back to the reporting controller.
            let source = obj
                .source
                .map(|s| s.component.get())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| reporting.clone());
            out.push(("involvedObject.kind", io.kind.get()));
            out.push(("involvedObject.namespace", io.namespace.get()));
            out.push(("involvedObject.name", io.name.get()));
            out.push(("involvedObject.uid", io.uid.get()));
            out.push(("involvedObject.apiVersion", io.api_version.get()));
            out.push(("involvedObject.resourceVersion", io.resource_version.get()));
            out.push(("involvedObject.fieldPath", io.field_path.get()));
            out.push(("reason", obj.reason.get()));
            out.push(("reportingComponent", reporting));
            out.push(("source", source));
            out.push(("type", obj.type_.get()));
        }
        ("", "namespaces") => out.push(("status.phase", status.phase.get())),
        ("", "secrets") => out.push(("type", obj.type_.get())),
        ("", "services") => {
            out.push(("spec.clusterIP", spec.cluster_ip.get()));
            out.push(("spec.type", spec.type_.get()));
        }
        ("batch", "jobs") => {
            out.push((
                "status.successful",
                status.succeeded.unwrap_or(0).to_string(),
            ));
        }
        ("certificates.k8s.io", "certificatesigningrequests") => {
            out.push(("spec.signerName", spec.signer_name.get()));
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn labels<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<&'a str> {
        move |k| pairs.iter().find(|(key, _)| *key == k).map(|(_, v)| *v)
    }

    fn label_err(s: &str) -> String {
        match LabelSelector::parse(s) {
            Err(SelectorError::Label(m)) => m,
            other => panic!("{s:?}: expected a label error, got {other:?}"),
        }
    }

    const NAME_PART_REGEX: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
    const VALUE_REGEX: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";

    #[test]
    fn valid_label_selectors_parse_to_the_canonical_string() {
        let cases = [
            ("", ""),
            ("x=a", "x=a"),
            ("x==a", "x==a"),
            ("x!=a", "x!=a"),
            ("x", "x"),
            ("!x", "!x"),
            ("  x  ", "x"),
            ("x=", "x="),
            ("x>1", "x>1"),
            ("x<1", "x<1"),
            ("x in (b,a,a)", "x in (a,b)"),
            ("x notin (a)", "x notin (a)"),
            ("x in ()", "x in ()"),
            ("x in (,a)", "x in (,a)"),
            ("x in (a,)", "x in (,a)"),
            ("x in (a,,b)", "x in (,a,b)"),
            ("x in (in,notin)", "x in (in,notin)"),
            ("in=notin", "in=notin"),
            ("z=1,a=2,m", "a=2,m,z=1"),
            ("x=a,x!=b", "x=a,x!=b"),
            ("example.com/app=web", "example.com/app=web"),
            ("a\tin\t(b)", "a in (b)"),
        ];
        for (input, want) in cases {
            let sel = LabelSelector::parse(input).unwrap_or_else(|e| panic!("{input:?}: {e}"));
            assert_eq!(sel.to_string(), want, "input {input:?}");
        }
    }

    #[test]
    fn invalid_label_selectors_fail_with_the_apiservers_message() {
        let cases: &[(&str, String)] = &[
            (
                "x=a b",
                "found 'b', expected: ',' or 'end of string'".into(),
            ),
            (
                "x a",
                "unable to parse requirement: found 'a', expected: in, notin, =, ==, !=, gt, lt"
                    .into(),
            ),
            (
                "x in a",
                "unable to parse requirement: found 'a' expected: '('".into(),
            ),
            (
                "x in (a",
                "unable to parse requirement: found '', expected: ',' or ')'".into(),
            ),
            (
                "x in (a b)",
                "unable to parse requirement: found 'b', expected: ',' or ')'".into(),
            ),
            (
                "x in (=)",
                "unable to parse requirement: found '=', expected: ',', ')' or identifier".into(),
            ),
            ("x,", "found '', expected: identifier after ','".into()),
            (",x", "found ',', expected: !, identifier, or 'end of string'".into()),
            (
                "!",
                "unable to parse requirement: found '', expected: identifier".into(),
            ),
            ("!x=a", "found '=', expected: ',' or 'end of string'".into()),
            ("x=a\ny", "found 'y', expected: ',' or 'end of string'".into()),
            (
                "x in (,,)",
                "unable to parse requirement: found ')', expected: ',', or identifier".into(),
            ),
            (
                "x=(",
                "unable to parse requirement: found '(', expected: identifier".into(),
            ),
            (
                "x>a",
                "unable to parse requirement: values[0]: Invalid value: \"a\": for 'Gt', 'Lt' operators, the value must be an integer".into(),
            ),
            (
                "x>",
                "unable to parse requirement: values[0]: Invalid value: \"\": for 'Gt', 'Lt' operators, the value must be an integer".into(),
            ),
            (
                "x>-1",
                format!("unable to parse requirement: values[0][x]: Invalid value: \"-1\": {VALUE_REGEX}"),
            ),
            (
                "a@b=c",
                format!("unable to parse requirement: <nil>: Invalid value: \"a@b\": {NAME_PART_REGEX}"),
            ),
            (
                "/a",
                "unable to parse requirement: <nil>: Invalid value: \"/a\": prefix part must be non-empty".into(),
            ),
            (
                "a/b/c",
                "unable to parse requirement: <nil>: Invalid value: \"a/b/c\": a valid label key must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')".into(),
            ),
            (
                "Ex.com/a",
                "unable to parse requirement: <nil>: Invalid value: \"Ex.com/a\": prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')".into(),
            ),
            (
                "a/",
                format!("unable to parse requirement: <nil>: Invalid value: \"a/\": name part must be non-empty; {NAME_PART_REGEX}"),
            ),
            (
                &format!("{}=a", "k".repeat(64)),
                format!("unable to parse requirement: <nil>: Invalid value: \"{}\": name part must be no more than 63 bytes", "k".repeat(64)),
            ),
            (
                "x in (-a,-b)",
                format!("unable to parse requirement: [values[0][x]: Invalid value: \"-a\": {VALUE_REGEX}, values[1][x]: Invalid value: \"-b\": {VALUE_REGEX}]"),
            ),
            (
                &format!("x={}", "v".repeat(64)),
                format!("unable to parse requirement: values[0][x]: Invalid value: \"{}\": must be no more than 63 bytes", "v".repeat(64)),
            ),
        ];
        for (input, want) in cases {
            assert_eq!(&label_err(input), want, "input {input:?}");
        }
    }

    #[test]
    fn a_label_selector_error_displays_as_the_bare_apiserver_message() {
        let err = LabelSelector::parse("x in a").unwrap_err();
        assert_eq!(
            err.to_string(),
            "unable to parse requirement: found 'a' expected: '('"
        );
    }

    #[test]
    fn a_nul_byte_between_tokens_ends_the_label_selector_like_go() {
        // Go's lexer reads 0 for both end of input and NUL.
        assert_eq!(LabelSelector::parse("x \0y").unwrap().to_string(), "x");
    }

    #[test]
    fn label_selectors_match_as_the_apiserver_does() {
        let web = [("app", "web"), ("tier", "front"), ("n", "10")];
        let none: [(&str, &str); 0] = [];
        type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], bool);
        let cases: &[Case<'_>] = &[
            ("", &none, true),
            ("app=web", &web, true),
            ("app==web", &web, true),
            ("app=db", &web, false),
            ("app=web", &none, false),
            ("app!=db", &web, true),
            ("app!=web", &web, false),
            ("app!=web", &none, true),
            ("app in (db,web)", &web, true),
            ("app in (db)", &web, false),
            ("app in (db)", &none, false),
            ("app notin (web)", &web, false),
            ("app notin (db)", &web, true),
            ("app notin (web)", &none, true),
            ("app", &web, true),
            ("app", &none, false),
            ("!app", &web, false),
            ("!app", &none, true),
            ("n>9", &web, true),
            ("n>10", &web, false),
            ("n<11", &web, true),
            ("n<10", &web, false),
            ("app>1", &web, false),
            ("n>1", &none, false),
            ("app=", &[("app", "")], true),
            ("app=", &none, false),
            ("app in ()", &[("app", "")], true),
            ("app=web,tier=front", &web, true),
            ("app=web,tier=back", &web, false),
        ];
        for (sel, ls, want) in cases {
            let parsed = LabelSelector::parse(sel).unwrap();
            assert_eq!(parsed.matches(labels(ls)), *want, "{sel:?} on {ls:?}");
        }
    }

    #[test]
    fn the_empty_label_selector_is_everything() {
        assert!(LabelSelector::parse("").unwrap().is_everything());
        assert_eq!(LabelSelector::parse(" ").unwrap(), LabelSelector::default());
        assert!(!LabelSelector::parse("a").unwrap().is_everything());
    }

    #[test]
    fn label_exact_value_reports_single_valued_equality_only() {
        let sel = LabelSelector::parse("a=1,b in (2),c in (3,4),d!=5").unwrap();
        assert_eq!(sel.exact_value("a"), Some("1"));
        assert_eq!(sel.exact_value("b"), Some("2"));
        assert_eq!(sel.exact_value("c"), None);
        assert_eq!(sel.exact_value("d"), None);
        assert_eq!(sel.exact_value("e"), None);
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
            assert_eq!(parsed.matches(labels(&obj)), *want, "{sel:?}");
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

    #[test]
    fn pods_accept_their_fields_and_rewrite_spec_host() {
        let sel = FieldSelector::parse("spec.host=n1,status.phase=Running").unwrap();
        let FieldCheck::Cache(conv) = check_builtin_field_selector("", "pods", &sel) else {
            panic!("pods must be cacheable");
        };
        assert_eq!(conv.exact_value("spec.nodeName"), Some("n1"));
        assert_eq!(conv.to_string(), "spec.nodeName=n1,status.phase=Running");
    }

    #[test]
    fn unsupported_fields_are_rejected_with_the_conversion_funcs_message() {
        let check = |g, r, s| check_builtin_field_selector(g, r, &FieldSelector::parse(s).unwrap());
        assert_eq!(
            check("", "pods", "spec.foo=1,zzz=2"),
            FieldCheck::Reject(SelectorError::UnsupportedField(
                "field label not supported: spec.foo".into()
            ))
        );
        assert_eq!(
            check("", "nodes", "metadata.namespace=x"),
            FieldCheck::Reject(SelectorError::UnsupportedField(
                "field label not supported: metadata.namespace".into()
            ))
        );
        assert_eq!(
            check("batch", "jobs", "status.active=1"),
            FieldCheck::Reject(SelectorError::UnsupportedField(
                "field label \"status.active\" not supported for Job".into()
            ))
        );
    }

    #[test]
    fn unmodelled_and_aggregated_kinds_cache_only_metadata_fields() {
        let check = |g, r, s| check_builtin_field_selector(g, r, &FieldSelector::parse(s).unwrap());
        assert!(matches!(
            check("apps", "deployments", "metadata.name=a"),
            FieldCheck::Cache(_)
        ));
        assert_eq!(
            check("apps", "deployments", "status.replicas=1"),
            FieldCheck::Passthrough
        );
        assert_eq!(
            check("example.com", "widgets", "spec.color=red"),
            FieldCheck::Passthrough
        );
        assert_eq!(
            check("events.k8s.io", "events", "metadata.name=a"),
            FieldCheck::Passthrough
        );
        assert!(matches!(
            check("events.k8s.io", "events", ""),
            FieldCheck::Cache(_)
        ));
    }

    fn widgets(namespaced: bool, paths: &[&str]) -> Resource {
        Resource::test_widgets(namespaced, paths)
    }

    #[test]
    fn selectable_field_labels_are_the_json_paths_without_the_leading_dot() {
        let f = CustomFields::from_json_paths([".spec.color", ".spec.size", ".status.x-y_1"]);
        assert_eq!(
            f.labels().collect::<Vec<_>>(),
            ["spec.color", "spec.size", "status.x-y_1"]
        );
        assert!(!f.is_opaque() && !f.is_empty());
        assert!(CustomFields::from_json_paths([]).is_empty());
        // Paths the proxy does not evaluate exactly make every declared field opaque.
        for odd in [
            "spec.color",
            ".spec..color",
            ".spec.",
            ".spec['color']",
            ".spec.colors[0]",
            ".spec.a b",
            ".spec.*",
            ".spec.a\\.b",
        ] {
            let f = CustomFields::from_json_paths([".spec.size", odd]);
            assert!(f.is_opaque() && !f.is_empty(), "{odd}");
            assert!(f.evaluated().is_empty(), "{odd}");
        }
    }

    /// `crConverter.ConvertFieldLabel`: metadata.name always, metadata.namespace only when
    /// namespaced, declared fields of the version, anything else rejected with the apiserver's
    /// message (the router hands rejections to the apiserver, which writes the 400).
    #[test]
    fn custom_resources_accept_their_selectable_fields_and_reject_others() {
        let check =
            |r: &Resource, s: &str| check_field_selector(r, &FieldSelector::parse(s).unwrap());
        let ns = widgets(true, &[".spec.color", ".spec.size"]);
        let cluster = widgets(false, &[".spec.color"]);
        let cached = |r: &Resource, s: &str| match check(r, s) {
            FieldCheck::Cache(f) => f.to_string(),
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(cached(&ns, ""), "");
        assert_eq!(cached(&ns, "spec.color=red"), "spec.color=red");
        assert_eq!(
            cached(&ns, "spec.size!=3,metadata.namespace=a,metadata.name==w"),
            "metadata.name=w,metadata.namespace=a,spec.size!=3"
        );
        assert_eq!(
            cached(&cluster, "metadata.name=w,spec.color="),
            "metadata.name=w,spec.color="
        );
        let rejected = |r: &Resource, s: &str| match check(r, s) {
            FieldCheck::Reject(SelectorError::UnsupportedField(m)) => m,
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(
            rejected(&ns, "spec.weight=1"),
            "field label not supported: spec.weight"
        );
        // The first unsupported label in the apiserver's (sorted) order is named.
        assert_eq!(
            rejected(&ns, "status.z=1,spec.a=1,spec.color=red"),
            "field label not supported: spec.a"
        );
        assert_eq!(
            rejected(&cluster, "metadata.namespace=a"),
            "field label not supported: metadata.namespace"
        );
        // The path form, with its dot, is not a label.
        assert_eq!(
            rejected(&ns, ".spec.color=red"),
            "field label not supported: .spec.color"
        );
        assert_eq!(
            rejected(&widgets(true, &[]), "spec.color=red"),
            "field label not supported: spec.color"
        );
        // A CRD declaring a path the proxy does not evaluate: the apiserver decides.
        let odd = widgets(true, &[".spec.color", ".spec['a.b']"]);
        assert_eq!(check(&odd, "spec.color=red"), FieldCheck::Passthrough);
        assert!(matches!(
            check(&odd, "metadata.name=w"),
            FieldCheck::Cache(_)
        ));
    }

    #[test]
    fn floats_print_as_go_fmt_sprint_prints_them() {
        // fmt.Sprint(float64(x)) in Go, for each x.
        let cases = [
            (0.0, "0"),
            (-0.0, "-0"),
            (1.5, "1.5"),
            (-2.25, "-2.25"),
            (100000.0, "100000"),
            (123456.0, "123456"),
            (999999.5, "999999.5"),
            (1e6, "1e+06"),
            (1234567.0, "1.234567e+06"),
            (1e21, "1e+21"),
            (1.5e300, "1.5e+300"),
            (0.0001, "0.0001"),
            (0.00012345, "0.00012345"),
            (0.00001, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (0.1 + 0.2, "0.30000000000000004"),
            (5e-324, "5e-324"),
        ];
        for (f, want) in cases {
            assert_eq!(go_format_float(f), want, "{f:e}");
        }
    }

    #[test]
    fn supported_fields_lists_the_kind_specific_fields() {
        assert!(supported_fields("", "pods").contains(&"spec.nodeName"));
        assert!(supported_fields("", "pods").contains(&"spec.hostNetwork"));
        assert_eq!(supported_fields("", "nodes"), ["spec.unschedulable"]);
        assert_eq!(supported_fields("", "secrets"), ["type"]);
        assert_eq!(supported_fields("batch", "jobs"), ["status.successful"]);
        assert!(supported_fields("", "configmaps").is_empty());
    }

    fn extracted(group: &str, resource: &str, raw: &str) -> BTreeMap<&'static str, String> {
        extract_fields(group, resource, raw.as_bytes())
            .unwrap()
            .into_iter()
            .collect()
    }

    #[test]
    fn pod_fields_are_extracted_like_to_selectable_fields() {
        let raw = r#"{"apiVersion":"v1","kind":"Pod",
            "metadata":{"name":"p","namespace":"ns","labels":{"a":"b"}},
            "spec":{"nodeName":"n\u0031","restartPolicy":"Always","schedulerName":"default-scheduler",
                    "serviceAccount":"old","hostNetwork":true,"containers":[{"name":"c"}]},
            "status":{"phase":"Running","podIPs":[{"ip":"10.0.0.1"},{"ip":"fd00::1"}],
                      "nominatedNodeName":null}}"#;
        let f = extracted("", "pods", raw);
        assert_eq!(f["metadata.name"], "p");
        assert_eq!(f["metadata.namespace"], "ns");
        assert_eq!(f["spec.nodeName"], "n1");
        assert_eq!(f["spec.restartPolicy"], "Always");
        assert_eq!(f["spec.schedulerName"], "default-scheduler");
        assert_eq!(f["spec.serviceAccountName"], "old");
        assert_eq!(f["spec.hostNetwork"], "true");
        assert_eq!(f["status.phase"], "Running");
        assert_eq!(f["status.podIP"], "10.0.0.1");
        assert_eq!(f["status.podIPs"], "");
        assert_eq!(f["status.nominatedNodeName"], "");

        let bare = extracted("", "pods", r#"{"metadata":{"name":"p"}}"#);
        assert_eq!(bare["spec.hostNetwork"], "false");
        assert_eq!(bare["metadata.namespace"], "");
        let with_pod_ip = extracted(
            "",
            "pods",
            r#"{"status":{"podIP":"10.0.0.9","podIPs":[{"ip":"10.0.0.1"}]}}"#,
        );
        assert_eq!(with_pod_ip["status.podIP"], "10.0.0.9");
    }

    #[test]
    fn other_kinds_fields_are_extracted_with_go_formatting() {
        let node = extracted(
            "",
            "nodes",
            r#"{"metadata":{"name":"n"},"spec":{"unschedulable":true}}"#,
        );
        assert_eq!(node["spec.unschedulable"], "true");
        let node = extracted("", "nodes", r#"{"metadata":{"name":"n"},"spec":{}}"#);
        assert_eq!(node["spec.unschedulable"], "false");
        let job = extracted("batch", "jobs", r#"{"status":{"succeeded":3}}"#);
        assert_eq!(job["status.successful"], "3");
        let job = extracted("batch", "jobs", r#"{"status":{}}"#);
        assert_eq!(job["status.successful"], "0");
        let rc = extracted("", "replicationcontrollers", r#"{"status":{"replicas":2}}"#);
        assert_eq!(rc["status.replicas"], "2");
        let secret = extracted(
            "",
            "secrets",
            r#"{"type":"kubernetes.io/tls","data":{"a":"Yg=="}}"#,
        );
        assert_eq!(secret["type"], "kubernetes.io/tls");
        let svc = extracted(
            "",
            "services",
            r#"{"spec":{"clusterIP":"10.96.0.1","type":"ClusterIP"}}"#,
        );
        assert_eq!(svc["spec.clusterIP"], "10.96.0.1");
        assert_eq!(svc["spec.type"], "ClusterIP");
        let ns = extracted("", "namespaces", r#"{"status":{"phase":"Active"}}"#);
        assert_eq!(ns["status.phase"], "Active");
        let csr = extracted(
            "certificates.k8s.io",
            "certificatesigningrequests",
            r#"{"spec":{"signerName":"kubernetes.io/kubelet-serving","request":"AAAA"}}"#,
        );
        assert_eq!(csr["spec.signerName"], "kubernetes.io/kubelet-serving");
        let cm = extracted(
            "",
            "configmaps",
            r#"{"metadata":{"name":"c","namespace":"d"},"data":{"x":"y"}}"#,
        );
        assert_eq!(cm.len(), 2);
        assert_eq!(cm["metadata.name"], "c");
    }

    #[test]
    fn event_source_falls_back_to_the_reporting_component() {
        let raw = r#"{"metadata":{"name":"e","namespace":"ns"},
            "involvedObject":{"kind":"Pod","name":"p","namespace":"ns","uid":"u","apiVersion":"v1",
                              "resourceVersion":"7","fieldPath":"spec.containers{c}"},
            "reason":"Started","type":"Normal","reportingComponent":"kubelet","source":{}}"#;
        let f = extracted("", "events", raw);
        assert_eq!(f["involvedObject.kind"], "Pod");
        assert_eq!(f["involvedObject.fieldPath"], "spec.containers{c}");
        assert_eq!(f["involvedObject.resourceVersion"], "7");
        assert_eq!(f["reason"], "Started");
        assert_eq!(f["type"], "Normal");
        assert_eq!(f["reportingComponent"], "kubelet");
        assert_eq!(f["source"], "kubelet");
        let raw = r#"{"source":{"component":"scheduler"},"reportingComponent":"x"}"#;
        assert_eq!(extracted("", "events", raw)["source"], "scheduler");
    }

    #[test]
    fn extraction_rejects_non_json() {
        assert!(extract_fields("", "pods", b"not json").is_err());
        assert!(extract_fields("", "configmaps", b"{").is_err());
    }

    // ----- properties -----

    fn name_part() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-zA-Z0-9]",
            "[a-zA-Z0-9][-a-zA-Z0-9_.]{0,8}[a-zA-Z0-9]",
            Just("in".to_string()),
            Just("notin".to_string()),
        ]
    }

    fn label_key() -> impl Strategy<Value = String> {
        (
            proptest::option::of("[a-z0-9]{1,4}(\\.[a-z0-9]{1,4}){0,2}"),
            name_part(),
        )
            .prop_map(|(prefix, name)| match prefix {
                Some(p) => format!("{p}/{name}"),
                None => name,
            })
    }

    fn label_value() -> impl Strategy<Value = String> {
        prop_oneof![Just(String::new()), name_part(), "[0-9]{1,3}"]
    }

    /// A value list Go accepts: the empty value only as a leading `,` (Go rejects `(,,)` and
    /// `(a,,)`), or `()` for the empty value alone.
    fn set_list(vals: &[String]) -> String {
        let non_empty: Vec<&str> = vals
            .iter()
            .map(String::as_str)
            .filter(|v| !v.is_empty())
            .collect();
        let lead = if non_empty.len() < vals.len() && !non_empty.is_empty() {
            ","
        } else {
            ""
        };
        format!("{lead}{}", non_empty.join(","))
    }

    fn requirement_text() -> impl Strategy<Value = String> {
        (
            label_key(),
            0..9u8,
            proptest::collection::vec(label_value(), 1..4),
            "[0-9]{1,3}",
        )
            .prop_map(|(k, op, vals, n)| match op {
                0 => format!("{k}={}", vals[0]),
                1 => format!("{k}=={}", vals[0]),
                2 => format!("{k}!={}", vals[0]),
                3 => format!("{k} in ({})", set_list(&vals)),
                4 => format!("{k} notin ({})", set_list(&vals)),
                5 => k,
                6 => format!("!{k}"),
                7 => format!("{k}>{n}"),
                _ => format!("{k} < {n}"),
            })
    }

    fn label_set() -> impl Strategy<Value = Vec<(String, String)>> {
        proptest::collection::vec((label_key(), label_value()), 0..6)
    }

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
        fn label_selectors_round_trip_through_their_string(
            reqs in proptest::collection::vec(requirement_text(), 0..5),
            set in label_set(),
        ) {
            let text = reqs.join(",");
            let sel = LabelSelector::parse(&text).unwrap();
            let printed = sel.to_string();
            let again = LabelSelector::parse(&printed).unwrap();
            prop_assert_eq!(&again, &sel);
            prop_assert_eq!(again.to_string(), printed);
            let lookup = |k: &str| set.iter().rev().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
            prop_assert_eq!(sel.matches(lookup), again.matches(lookup));
        }

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
        fn label_parsing_never_panics(s in "[ a-z0-9=!(),<>/._\\x00-]{0,20}") {
            let _ = LabelSelector::parse(&s);
        }

        #[test]
        fn field_parsing_never_panics(s in "[ a-z0-9=!,\\\\.]{0,20}") {
            let _ = FieldSelector::parse(&s);
        }
    }
}
