//! Just enough RESP2 for the subscriber connection: encode commands, read
//! replies and pushed messages.

use std::io::{self, BufRead, Write};

/// One RESP2 value.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    Simple(String),
    Error(String),
    Integer(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Frame>>),
}

/// Bulk strings and arrays longer than this are refused: a subscriber only
/// ever receives short channel names and empty payloads.
const MAX_LEN: usize = 64 * 1024 * 1024;
/// Nesting deeper than this is refused (pushed messages are flat).
const MAX_DEPTH: u32 = 8;

/// Writes `args` as a RESP array of bulk strings.
pub(crate) fn write_command(out: &mut impl Write, args: &[&[u8]]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(16 + args.iter().map(|a| a.len() + 16).sum::<usize>());
    buf.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        buf.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        buf.extend_from_slice(arg);
        buf.extend_from_slice(b"\r\n");
    }
    out.write_all(&buf)?;
    out.flush()
}

/// Reads one frame; `Ok(None)` on a clean end of stream.
pub(crate) fn read_frame(input: &mut impl BufRead) -> io::Result<Option<Frame>> {
    read_at_depth(input, 0)
}

fn read_at_depth(input: &mut impl BufRead, depth: u32) -> io::Result<Option<Frame>> {
    if depth > MAX_DEPTH {
        return Err(invalid("RESP nesting too deep"));
    }
    let mut line = Vec::new();
    if input.read_until(b'\n', &mut line)? == 0 {
        return Ok(None);
    }
    if !line.ends_with(b"\r\n") || line.len() < 3 {
        return Err(invalid("RESP line without CRLF"));
    }
    let body = &line[1..line.len() - 2];
    let text = || String::from_utf8_lossy(body).into_owned();
    let frame = match line[0] {
        b'+' => Frame::Simple(text()),
        b'-' => Frame::Error(text()),
        b':' => Frame::Integer(parse_int(body)?),
        b'$' => {
            let len = parse_int(body)?;
            if len < 0 {
                Frame::Bulk(None)
            } else {
                let len = checked_len(len)?;
                let mut data = vec![0; len + 2];
                input.read_exact(&mut data)?;
                if !data.ends_with(b"\r\n") {
                    return Err(invalid("RESP bulk string without CRLF"));
                }
                data.truncate(len);
                Frame::Bulk(Some(data))
            }
        }
        b'*' => {
            let len = parse_int(body)?;
            if len < 0 {
                Frame::Array(None)
            } else {
                let len = checked_len(len)?;
                let mut items = Vec::with_capacity(len.min(16));
                for _ in 0..len {
                    match read_at_depth(input, depth + 1)? {
                        Some(item) => items.push(item),
                        None => return Err(invalid("RESP array cut short")),
                    }
                }
                Frame::Array(Some(items))
            }
        }
        _ => return Err(invalid("unknown RESP type byte")),
    };
    Ok(Some(frame))
}

fn parse_int(body: &[u8]) -> io::Result<i64> {
    std::str::from_utf8(body)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| invalid("RESP integer expected"))
}

fn checked_len(len: i64) -> io::Result<usize> {
    usize::try_from(len)
        .ok()
        .filter(|l| *l <= MAX_LEN)
        .ok_or_else(|| invalid("RESP length out of range"))
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

impl Frame {
    /// The bytes of a bulk or simple string.
    pub(crate) fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Frame::Bulk(Some(data)) => Some(data),
            Frame::Simple(text) => Some(text.as_bytes()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(bytes: &[u8]) -> Vec<Frame> {
        let mut input = std::io::BufReader::new(bytes);
        let mut frames = Vec::new();
        while let Some(frame) = read_frame(&mut input).expect("valid RESP") {
            frames.push(frame);
        }
        frames
    }

    #[test]
    fn encodes_commands_as_bulk_arrays() {
        let mut out = Vec::new();
        write_command(&mut out, &[b"SUBSCRIBE", b"ch:{a}"]).expect("write");
        assert_eq!(out, b"*2\r\n$9\r\nSUBSCRIBE\r\n$6\r\nch:{a}\r\n");
    }

    #[test]
    fn reads_pushes_and_replies() {
        let frames = read_all(
            b"+OK\r\n-ERR bad\r\n:3\r\n$-1\r\n*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n\
              *3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$0\r\n\r\n",
        );
        assert_eq!(frames[0], Frame::Simple("OK".into()));
        assert_eq!(frames[1], Frame::Error("ERR bad".into()));
        assert_eq!(frames[2], Frame::Integer(3));
        assert_eq!(frames[3], Frame::Bulk(None));
        assert_eq!(
            frames[4],
            Frame::Array(Some(vec![
                Frame::Bulk(Some(b"subscribe".to_vec())),
                Frame::Bulk(Some(b"ch".to_vec())),
                Frame::Integer(1),
            ]))
        );
        let Frame::Array(Some(items)) = &frames[5] else {
            panic!("array expected")
        };
        assert_eq!(items[2].as_bytes(), Some(&b""[..]));
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        for bad in [
            &b"?what\r\n"[..],
            b"$5\r\nab\r\n",
            b":x\r\n",
            b"*2\r\n:1\r\n",
            b"+no newline",
            b"$99999999999\r\n",
        ] {
            let mut input = std::io::BufReader::new(bad);
            let mut result = read_frame(&mut input);
            while let Ok(Some(_)) = result {
                result = read_frame(&mut input);
            }
            assert!(result.is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
