//! A single-pass JSON scanner for what the apiserver sends: it reads the few members the
//! cache needs (metadata, selectable fields, an event's type) and skips everything else
//! without decoding it, so ingest costs one walk over the bytes instead of one serde pass
//! per consumer.
//!
//! Skipping checks structure (strings terminated, brackets balanced and matched, nesting at
//! most [`MAX_DEPTH`], members separated as JSON requires) but does not validate every
//! scalar's grammar (nor refuse a stray backslash between tokens): the bytes come from the authenticated apiserver and are forwarded as
//! they are. Every string the cache *uses* (names, labels, field values) is fully decoded
//! and checked as UTF-8.

use std::borrow::Cow;

/// serde_json's recursion limit: nesting deeper than this is refused, as before.
pub const MAX_DEPTH: u32 = 128;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScanError {
    #[error("unexpected end of JSON input")]
    Eof,
    #[error("invalid JSON at byte {0}")]
    Syntax(usize),
    #[error("invalid JSON string at byte {0}")]
    Str(usize),
    #[error("JSON nested more than {MAX_DEPTH} levels")]
    TooDeep,
    #[error("unexpected JSON type at byte {at}: expected {want}")]
    Type { at: usize, want: &'static str },
}

const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

/// Bytes of `w` equal to `c` get their high bit set; the lowest set bit is exact (borrows
/// can only mark bytes above a real match).
#[inline(always)]
fn eq_mask(w: u64, c: u8) -> u64 {
    let v = w ^ (LO * u64::from(c));
    v.wrapping_sub(LO) & !v & HI
}

#[inline(always)]
fn word(s: &[u8], i: usize) -> Option<u64> {
    s.get(i..i + 8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
}

/// The closing quote of a string whose content starts at `i`, and whether it has escapes.
/// Eight bytes at a time.
#[inline(always)]
fn string_end(s: &[u8], mut i: usize) -> Result<(usize, bool), ScanError> {
    let mut escaped = false;
    while let Some(w) = word(s, i) {
        let m = eq_mask(w, b'"') | eq_mask(w, b'\\');
        if m == 0 {
            i += 8;
            continue;
        }
        let j = i + (m.trailing_zeros() / 8) as usize;
        if s[j] == b'"' {
            return Ok((j, escaped));
        }
        escaped = true;
        i = j + 2;
    }
    while i < s.len() {
        match s[i] {
            b'"' => return Ok((i, escaped)),
            b'\\' => {
                escaped = true;
                i += 2;
            }
            _ => i += 1,
        }
    }
    Err(ScanError::Eof)
}

/// 64 bytes of input; past the end of the input, spaces (which are never structural).
struct Block([u8; 64]);

/// One bit per byte of a [`Block`], bit i for byte i.
#[derive(Default)]
struct Masks {
    quote: u64,
    backslash: u64,
    /// `{` and `[`.
    open: u64,
    /// `}` and `]`.
    close: u64,
}

impl Block {
    #[inline(always)]
    fn at(s: &[u8], at: usize) -> Block {
        match s.get(at..at + 64) {
            Some(b) => Block(b.try_into().unwrap_or([b' '; 64])),
            None => {
                let mut b = [b' '; 64];
                let rest = &s[at.min(s.len())..];
                b[..rest.len()].copy_from_slice(rest);
                Block(b)
            }
        }
    }

    /// SSE2 (part of every x86-64 CPU): sixteen bytes per compare.
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    #[inline(always)]
    fn masks(&self) -> Masks {
        use safe_arch::{
            bitor_m128i, cmp_eq_mask_i8_m128i, load_unaligned_m128i, move_mask_i8_m128i,
            set_splat_i8_m128i,
        };
        let mut m = Masks::default();
        for (k, chunk) in self.0.chunks_exact(16).enumerate() {
            let v = load_unaligned_m128i(chunk.try_into().unwrap_or(&[0; 16]));
            // '{' | 0x20 == '{', '[' | 0x20 == '{'; likewise '}' and ']'.
            let folded = bitor_m128i(v, set_splat_i8_m128i(0x20));
            let eq = |x, c: u8| {
                let hit = cmp_eq_mask_i8_m128i(x, set_splat_i8_m128i(c as i8));
                u64::from(move_mask_i8_m128i(hit) as u16) << (16 * k)
            };
            m.quote |= eq(v, b'"');
            m.backslash |= eq(v, b'\\');
            m.open |= eq(folded, b'{');
            m.close |= eq(folded, b'}');
        }
        m
    }

    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    #[inline(always)]
    fn masks(&self) -> Masks {
        let mut m = Masks::default();
        for (i, &b) in self.0.iter().enumerate() {
            let bit = 1u64 << i;
            match b | 0x20 {
                _ if b == b'"' => m.quote |= bit,
                _ if b == b'\\' => m.backslash |= bit,
                b'{' => m.open |= bit,
                b'}' => m.close |= bit,
                _ => {}
            }
        }
        m
    }
}

/// Bit i set when an odd number of bits at or below i are set in `x`: for a quote mask, the
/// bytes from an opening quote up to (not including) its closing quote.
#[inline(always)]
fn prefix_xor(mut x: u64) -> u64 {
    x ^= x << 1;
    x ^= x << 2;
    x ^= x << 4;
    x ^= x << 8;
    x ^= x << 16;
    x ^= x << 32;
    x
}

/// The bytes escaped by a backslash: those right after an odd-length run of backslashes
/// (simdjson's stage 1). `carry` is 1 when the previous block ended in such a run, and is
/// set for the next block.
#[inline(always)]
fn escaped_by_odd_backslashes(backslash: u64, carry: &mut u64) -> u64 {
    const EVEN: u64 = 0x5555_5555_5555_5555;
    const ODD: u64 = !EVEN;
    let starts = backslash & !(backslash << 1);
    // A run continued from the previous block started on an odd bit if that run was odd.
    let even_start_mask = EVEN ^ *carry;
    let even_starts = starts & even_start_mask;
    let odd_starts = starts & !even_start_mask;
    let even_carries = backslash.wrapping_add(even_starts);
    let (mut odd_carries, overflow) = backslash.overflowing_add(odd_starts);
    odd_carries |= *carry;
    *carry = u64::from(overflow);
    let even_carry_ends = even_carries & !backslash;
    let odd_carry_ends = odd_carries & !backslash;
    (even_carry_ends & ODD) | (odd_carry_ends & EVEN)
}

/// A cursor over one JSON document.
pub struct Scanner<'a> {
    s: &'a [u8],
    i: usize,
}

/// A scalar read where a string, bool or number is expected.
#[derive(Debug, Clone, PartialEq)]
pub enum Scalar<'a> {
    Null,
    Bool(bool),
    /// The number's literal text.
    Num(&'a str),
    Str(Cow<'a, str>),
}

impl<'a> Scanner<'a> {
    pub fn new(s: &'a [u8]) -> Scanner<'a> {
        Scanner { s, i: 0 }
    }

    /// The whole document.
    pub fn text(&self) -> &'a [u8] {
        self.s
    }

    /// The byte offset of the cursor.
    pub fn pos(&self) -> usize {
        self.i
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(&b) = self.s.get(self.i) {
            if matches!(b, b' ' | b'\n' | b'\r' | b'\t') {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    /// The next significant byte, not consumed.
    #[inline]
    pub fn peek(&mut self) -> Result<u8, ScanError> {
        self.ws();
        self.s.get(self.i).copied().ok_or(ScanError::Eof)
    }

    #[inline]
    fn expect(&mut self, c: u8) -> Result<(), ScanError> {
        if self.peek()? == c {
            self.i += 1;
            Ok(())
        } else {
            Err(ScanError::Syntax(self.i))
        }
    }

    /// Only whitespace may follow.
    pub fn end(&mut self) -> Result<(), ScanError> {
        self.ws();
        if self.i == self.s.len() {
            Ok(())
        } else {
            Err(ScanError::Syntax(self.i))
        }
    }

    /// Skips a string whose opening quote is at the cursor: (content start, content end,
    /// whether it has escapes).
    #[inline]
    fn str_span(&mut self) -> Result<(usize, usize, bool), ScanError> {
        let start = self.i + 1;
        let (end, escaped) = string_end(self.s, start)?;
        self.i = end + 1;
        Ok((start, end, escaped))
    }

    /// A string, decoded; `None` for `null`.
    pub fn opt_string(&mut self) -> Result<Option<Cow<'a, str>>, ScanError> {
        match self.peek()? {
            b'"' => self.string().map(Some),
            b'n' => {
                self.literal(b"null")?;
                Ok(None)
            }
            _ => Err(ScanError::Type {
                at: self.i,
                want: "a string or null",
            }),
        }
    }

    /// A string, decoded.
    pub fn string(&mut self) -> Result<Cow<'a, str>, ScanError> {
        if self.peek()? != b'"' {
            return Err(ScanError::Type {
                at: self.i,
                want: "a string",
            });
        }
        let at = self.i;
        let (a, b, escaped) = self.str_span()?;
        if escaped {
            serde_json::from_slice::<String>(&self.s[at..self.i])
                .map(Cow::Owned)
                .map_err(|_| ScanError::Str(at))
        } else {
            std::str::from_utf8(&self.s[a..b])
                .map(Cow::Borrowed)
                .map_err(|_| ScanError::Str(at))
        }
    }

    fn literal(&mut self, lit: &[u8]) -> Result<(), ScanError> {
        if self.s.get(self.i..self.i + lit.len()) == Some(lit) {
            self.i += lit.len();
            Ok(())
        } else {
            Err(ScanError::Syntax(self.i))
        }
    }

    /// A string, bool, number or null.
    pub fn scalar(&mut self) -> Result<Scalar<'a>, ScanError> {
        match self.peek()? {
            b'"' => self.string().map(Scalar::Str),
            b'n' => self.literal(b"null").map(|_| Scalar::Null),
            b't' => self.literal(b"true").map(|_| Scalar::Bool(true)),
            b'f' => self.literal(b"false").map(|_| Scalar::Bool(false)),
            b'-' | b'0'..=b'9' => {
                let start = self.i;
                self.skip_bare();
                // Only ASCII digits, signs, '.', 'e'/'E' were consumed.
                let text = std::str::from_utf8(&self.s[start..self.i])
                    .map_err(|_| ScanError::Syntax(start))?;
                Ok(Scalar::Num(text))
            }
            _ => Err(ScanError::Type {
                at: self.i,
                want: "a string, number, bool or null",
            }),
        }
    }

    /// A number or literal: everything up to the next delimiter.
    #[inline]
    fn skip_bare(&mut self) {
        while let Some(&b) = self.s.get(self.i) {
            if matches!(b, b'-' | b'+' | b'.' | b'0'..=b'9' | b'e' | b'E' | b'a'..=b'z') {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    /// Skips one value of any type.
    pub fn skip(&mut self) -> Result<(), ScanError> {
        match self.peek()? {
            b'"' => self.str_span().map(|_| ()),
            b'{' | b'[' => self.skip_container(),
            _ => {
                let start = self.i;
                self.skip_bare();
                if self.i == start {
                    Err(ScanError::Syntax(start))
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Skips an object or array at the cursor, 64 bytes at a time: each block is classified
    /// into bit masks (quotes, backslashes, brackets), escaped quotes are removed, the bytes
    /// inside strings are found with a prefix XOR over the quote mask, and only the brackets
    /// outside strings are visited, matched with a bit stack.
    fn skip_container(&mut self) -> Result<(), ScanError> {
        let s = self.s;
        let mut base = self.i;
        let mut depth = 0u32;
        // Bit set: the open container at that depth is an object.
        let mut objects: u128 = 0;
        // All ones when the previous block ended inside a string.
        let mut in_string: u64 = 0;
        // 1 when the previous block ended in an odd run of backslashes.
        let mut odd_carry: u64 = 0;
        while base < s.len() {
            let block = Block::at(s, base);
            let m = block.masks();
            let escaped = if m.backslash == 0 && odd_carry == 0 {
                0
            } else {
                escaped_by_odd_backslashes(m.backslash, &mut odd_carry)
            };
            let inside = prefix_xor(m.quote & !escaped) ^ in_string;
            in_string = ((inside as i64) >> 63) as u64;
            let mut brackets = (m.open | m.close) & !inside;
            while brackets != 0 {
                let bit = brackets.trailing_zeros() as usize;
                brackets &= brackets - 1;
                let b = block.0[bit];
                if m.open >> bit & 1 == 1 {
                    if depth == MAX_DEPTH {
                        return Err(ScanError::TooDeep);
                    }
                    objects = (objects << 1) | u128::from(b == b'{');
                    depth += 1;
                } else {
                    // '}' or ']'
                    if depth == 0 || (objects & 1 == 1) != (b == b'}') {
                        return Err(ScanError::Syntax(base + bit));
                    }
                    objects >>= 1;
                    depth -= 1;
                    if depth == 0 {
                        self.i = base + bit + 1;
                        return Ok(());
                    }
                }
            }
            base += 64;
        }
        Err(ScanError::Eof)
    }

    /// Visits an object's members: `f(scanner, key)` must consume the member's value. `null`
    /// is an object without members.
    pub fn object(
        &mut self,
        mut f: impl FnMut(&mut Self, Cow<'a, str>) -> Result<(), ScanError>,
    ) -> Result<(), ScanError> {
        match self.peek()? {
            b'{' => self.i += 1,
            b'n' => return self.literal(b"null"),
            _ => {
                return Err(ScanError::Type {
                    at: self.i,
                    want: "an object",
                });
            }
        }
        if self.peek()? == b'}' {
            self.i += 1;
            return Ok(());
        }
        loop {
            let k = self.string()?;
            self.expect(b':')?;
            f(self, k)?;
            match self.peek()? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return Err(ScanError::Syntax(self.i)),
            }
        }
    }

    /// Visits an array's elements: `f(scanner, index)` must consume each. `null` is empty.
    pub fn array(
        &mut self,
        mut f: impl FnMut(&mut Self, usize) -> Result<(), ScanError>,
    ) -> Result<(), ScanError> {
        match self.peek()? {
            b'[' => self.i += 1,
            b'n' => return self.literal(b"null"),
            _ => {
                return Err(ScanError::Type {
                    at: self.i,
                    want: "an array",
                });
            }
        }
        if self.peek()? == b']' {
            self.i += 1;
            return Ok(());
        }
        let mut n = 0;
        loop {
            f(self, n)?;
            n += 1;
            match self.peek()? {
                b',' => self.i += 1,
                b']' => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return Err(ScanError::Syntax(self.i)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn skip_all(s: &str) -> Result<(), ScanError> {
        let mut sc = Scanner::new(s.as_bytes());
        sc.skip()?;
        sc.end()
    }

    #[test]
    fn skips_valid_documents_and_refuses_broken_structure() {
        for ok in [
            r#"{}"#,
            r#"[]"#,
            r#"{"a":[1,2,{"b":"c\"}]"}],"d":null,"e":true}"#,
            r#" { "a" : "x\\" , "b" : [ ] } "#,
            r#""plain""#,
            "-1.5e3",
        ] {
            skip_all(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            r#"{"a":1"#,
            r#"{"a":[1}"#,
            r#"[1]]"#,
            r#"{"a":"x}"#,
            r#"{"a":"x\"}"#,
            "",
            "]",
        ] {
            assert!(skip_all(bad).is_err(), "{bad}");
        }
        let deep = "[".repeat(129) + &"]".repeat(129);
        assert_eq!(skip_all(&deep), Err(ScanError::TooDeep));
        let ok = "[".repeat(128) + &"]".repeat(128);
        skip_all(&ok).unwrap();
    }

    #[test]
    fn strings_are_decoded_and_checked() {
        let mut sc = Scanner::new(br#""a\u00e9\n\"b""#);
        assert_eq!(sc.string().unwrap(), "a\u{e9}\n\"b");
        let mut sc = Scanner::new(b"\"\xff\"");
        assert!(matches!(sc.string(), Err(ScanError::Str(0))));
        let mut sc = Scanner::new(br#"{"k":"v","n":null,"t":true,"x":-12}"#);
        let mut seen = vec![];
        sc.object(|s, k| {
            seen.push((k.into_owned(), s.scalar()?));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            seen,
            [
                ("k".to_string(), Scalar::Str("v".into())),
                ("n".to_string(), Scalar::Null),
                ("t".to_string(), Scalar::Bool(true)),
                ("x".to_string(), Scalar::Num("-12")),
            ]
        );
    }

    /// Bytewise container skip: strings stepped over escape by escape, brackets on a stack.
    fn reference_skip(s: &[u8], mut i: usize) -> Result<usize, ScanError> {
        let mut stack = Vec::new();
        while i < s.len() {
            match s[i] {
                b'"' => {
                    i += 1;
                    loop {
                        match s.get(i) {
                            None => return Err(ScanError::Eof),
                            Some(b'\\') => i += 2,
                            Some(b'"') => break,
                            Some(_) => i += 1,
                        }
                    }
                }
                // Outside strings (invalid JSON, which skipping does not refuse): a quote
                // after an odd run of backslashes does not open a string.
                b'\\' => {
                    let run = s[i..].iter().take_while(|b| **b == b'\\').count();
                    i += run;
                    if run % 2 == 1 && s.get(i) == Some(&b'"') {
                        i += 1;
                    }
                    continue;
                }
                b @ (b'{' | b'[') => {
                    if stack.len() == MAX_DEPTH as usize {
                        return Err(ScanError::TooDeep);
                    }
                    stack.push(b);
                }
                b @ (b'}' | b']') => {
                    match stack.pop() {
                        Some(o) if (o == b'{') == (b == b'}') => {}
                        _ => return Err(ScanError::Syntax(i)),
                    }
                    if stack.is_empty() {
                        return Ok(i + 1);
                    }
                }
                _ => {}
            }
            i += 1;
        }
        Err(ScanError::Eof)
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(serde_json::Value::from),
            ".*".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(6, 64, 8, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8).prop_map(serde_json::Value::from),
                proptest::collection::btree_map(".*", inner, 0..8)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Any JSON document is skipped to its exact end, and every truncation of it is
        /// refused (an object or array cut short never passes as complete).
        #[test]
        fn skip_finds_the_end_of_any_document(v in json_value(), pretty in any::<bool>()) {
            let text = if pretty {
                serde_json::to_string_pretty(&v).unwrap()
            } else {
                serde_json::to_string(&v).unwrap()
            };
            let doubled = format!("{text},{text}");
            let mut sc = Scanner::new(doubled.as_bytes());
            sc.skip().unwrap();
            prop_assert_eq!(sc.pos(), text.len());
            if text.starts_with('{') || text.starts_with('[') || text.starts_with('"') {
                for cut in 1..text.len() {
                    if !text.is_char_boundary(cut) {
                        continue;
                    }
                    prop_assert!(skip_all(&text[..cut]).is_err(), "{}", &text[..cut]);
                }
            }
        }

        /// The 64-byte block skipper agrees with a byte-at-a-time reference on any mix of
        /// quotes, backslash runs and brackets, at any alignment and across block edges:
        /// same end, or same error.
        #[test]
        fn block_skip_agrees_with_a_bytewise_reference(
            open in prop_oneof![Just(b'{'), Just(b'[')],
            body in proptest::collection::vec(
                prop_oneof![
                    4 => Just(b'\\'), 4 => Just(b'"'), 2 => Just(b'{'), 2 => Just(b'}'),
                    2 => Just(b'['), 2 => Just(b']'), 3 => Just(b'a'), 1 => Just(b' '),
                ],
                0..400,
            ),
            lead in 0usize..70,
        ) {
            let mut doc = vec![b' '; lead];
            doc.push(open);
            doc.extend_from_slice(&body);
            let mut sc = Scanner::new(&doc);
            let got = sc.skip().map(|()| sc.pos());
            prop_assert_eq!(got, reference_skip(&doc, lead));
        }

        /// Objects' members are visited with their keys decoded exactly.
        #[test]
        fn object_members_match_serde(m in proptest::collection::btree_map(".*", ".*", 0..10)) {
            let text = serde_json::to_string(&m).unwrap();
            let mut sc = Scanner::new(text.as_bytes());
            let mut got = std::collections::BTreeMap::new();
            sc.object(|s, k| {
                got.insert(k.into_owned(), s.string()?.into_owned());
                Ok(())
            }).unwrap();
            prop_assert_eq!(got, m);
        }
    }
}
