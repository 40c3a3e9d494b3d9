//! Label selectors (`labels.Parse`, `labels.Requirement` in
//! `k8s.io/apimachinery/pkg/labels/selector.go`): requirements, the recursive descent parser
//! with the apiserver's error messages, matching and the canonical string.

use std::borrow::Cow;
use std::fmt;

use super::SelectorError;
use super::lexer::{Lexer, Token};
use super::validation::{field_invalid, label_key_errors, label_value_errors};

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
        let mut lexer = Lexer::new(s);
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
        fn label_parsing_never_panics(s in "[ a-z0-9=!(),<>/._\\x00-]{0,20}") {
            let _ = LabelSelector::parse(&s);
        }
    }
}
