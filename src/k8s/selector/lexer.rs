//! The byte lexer of label selectors (`labels.Lexer` in
//! `k8s.io/apimachinery/pkg/labels/selector.go`): tokens and their literals, including Go's
//! handling of NUL bytes.

use std::borrow::Cow;

/// Lexer tokens, as in `labels.Token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Token {
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
pub(super) struct Lexer<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Lexer<'a> {
    pub(super) fn new(s: &'a str) -> Self {
        Lexer { s, pos: 0 }
    }

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

    pub(super) fn lex(&mut self) -> (Token, Cow<'a, str>) {
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
