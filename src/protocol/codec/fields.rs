//! The fields a frame body is made of: [`Writer`] appends them little-endian, [`Reader`] reads
//! them back from untrusted bytes (every read checked and named, see `codec.rs`), and the
//! stable tags of the enums they carry.

use crate::memory::RemoteMemory;
use std::ops::Range;

use uuid::Uuid;

use super::DecodeError;
use crate::layout::{AttentionKind, Dtype, PageOrder};
use crate::protocol::{
    MAX_AUX, MAX_HELD_ROOMS, MAX_PAGES, MAX_RUNS, MAX_STRING, Placed, Ranks, Role, Secret,
    WireLayout,
};
use crate::reason::FailureCode;

/// A length as a u32 field; lengths beyond u32 saturate, which every limit check refuses.
pub(super) fn saturate(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Appends little-endian fields to a frame.
pub(super) struct Writer<'a>(pub(super) &'a mut Vec<u8>);

impl Writer<'_> {
    pub(super) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    pub(super) fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn uuid(&mut self, v: &Uuid) {
        self.0.extend_from_slice(v.as_bytes());
    }

    pub(super) fn range(&mut self, r: &Range<u32>) {
        self.u32(r.start);
        self.u32(r.end);
    }

    pub(super) fn opt_u64(&mut self, v: Option<u64>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.u64(v);
            }
            None => self.u8(0),
        }
    }

    /// `N` bytes as they are.
    pub(super) fn fixed<const N: usize>(&mut self, v: &[u8; N]) {
        self.0.extend_from_slice(v);
    }

    /// 16 bytes.
    pub(super) fn secret(&mut self, v: &Secret) {
        self.0.extend_from_slice(v.as_bytes());
    }

    /// Tag 0, or tag 1 + 16 bytes.
    pub(super) fn opt_secret(&mut self, v: Option<&Secret>) {
        self.opt16(v.map(Secret::as_bytes));
    }

    /// Tag 0, or tag 1 + 16 bytes.
    pub(super) fn opt16(&mut self, v: Option<&[u8; 16]>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.0.extend_from_slice(v);
            }
            None => self.u8(0),
        }
    }

    /// u16 length + UTF-8, cut at a character boundary to at most `MAX_STRING` bytes.
    pub(super) fn str(&mut self, s: &str) {
        let mut end = s.len().min(MAX_STRING);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        let bytes = s.as_bytes().get(..end).unwrap_or_default();
        self.u16(u16::try_from(bytes.len()).unwrap_or(u16::MAX));
        self.0.extend_from_slice(bytes);
    }

    /// u32 length + bytes.
    /// Tag 0, or tag 1 + base + size + key blob.
    pub(super) fn memory(&mut self, m: Option<&RemoteMemory>) {
        match m {
            Some(m) => {
                self.u8(1);
                self.u64(m.base);
                self.u64(m.size);
                self.blob(&m.key);
            }
            None => self.u8(0),
        }
    }

    /// Tag 0, or tag 1 + key + u32 count + u64 lengths.
    pub(super) fn placed(&mut self, p: Option<&Placed>) {
        match p {
            Some(p) => {
                self.u8(1);
                self.u64(p.key);
                self.u32(saturate(p.runs.len()));
                for &len in &p.runs {
                    self.u64(len);
                }
            }
            None => self.u8(0),
        }
    }

    pub(super) fn blob(&mut self, b: &[u8]) {
        self.u32(saturate(b.len()));
        self.0.extend_from_slice(b);
    }

    /// u32 count + items.
    pub(super) fn pages(&mut self, pages: &[u32]) {
        self.u32(saturate(pages.len()));
        for &p in pages {
            self.u32(p);
        }
    }

    /// Tag 0, or tag 1 + u32 count + items.
    pub(super) fn opt_pages(&mut self, pages: Option<&[u32]>) {
        match pages {
            Some(pages) => {
                self.u8(1);
                self.pages(pages);
            }
            None => self.u8(0),
        }
    }

    /// u32 count + items.
    pub(super) fn rooms(&mut self, rooms: &[u64]) {
        self.u32(saturate(rooms.len()));
        for &r in rooms {
            self.u64(r);
        }
    }

    pub(super) fn ranks(&mut self, r: &Ranks) {
        for v in [
            r.dp_rank, r.dp_size, r.tp_rank, r.tp_size, r.pp_rank, r.pp_size,
        ] {
            self.u32(v);
        }
    }

    pub(super) fn layout(&mut self, l: &WireLayout) {
        self.u8(kind_tag(l.kind));
        self.u8(dtype_tag(l.dtype));
        self.u8(order_tag(l.order));
        self.u32(l.num_layers);
        self.u32(l.num_kv_heads);
        self.u32(l.head_dim);
        self.u32(l.page_size);
        self.range(&l.heads);
        self.range(&l.layers);
    }
}

/// A cursor over untrusted bytes: every read is checked and names the field it reads.
pub(super) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub(super) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if n > self.buf.len() {
            return Err(DecodeError::Truncated {
                what,
                needed: n,
                available: self.buf.len(),
            });
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    pub(super) fn array<const N: usize>(
        &mut self,
        what: &'static str,
    ) -> Result<[u8; N], DecodeError> {
        let Some((head, rest)) = self.buf.split_first_chunk::<N>() else {
            return Err(DecodeError::Truncated {
                what,
                needed: N,
                available: self.buf.len(),
            });
        };
        self.buf = rest;
        Ok(*head)
    }

    pub(super) fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(u8::from_le_bytes(self.array(what)?))
    }

    pub(super) fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub(super) fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(super) fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(super) fn uuid(&mut self, what: &'static str) -> Result<Uuid, DecodeError> {
        Ok(Uuid::from_bytes(self.array(what)?))
    }

    pub(super) fn range(&mut self, what: &'static str) -> Result<Range<u32>, DecodeError> {
        let start = self.u32(what)?;
        let end = self.u32(what)?;
        if start > end {
            return Err(DecodeError::BadRange { what, start, end });
        }
        Ok(start..end)
    }

    pub(super) fn opt_u64(&mut self, what: &'static str) -> Result<Option<u64>, DecodeError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.u64(what)?)),
            tag => Err(DecodeError::BadTag { what, tag }),
        }
    }

    pub(super) fn secret(&mut self, what: &'static str) -> Result<Secret, DecodeError> {
        Ok(Secret::from_bytes(self.array(what)?))
    }

    pub(super) fn opt_secret(&mut self, what: &'static str) -> Result<Option<Secret>, DecodeError> {
        Ok(self.opt16(what)?.map(Secret::from_bytes))
    }

    pub(super) fn opt16(&mut self, what: &'static str) -> Result<Option<[u8; 16]>, DecodeError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.array(what)?)),
            tag => Err(DecodeError::BadTag { what, tag }),
        }
    }

    pub(super) fn flag(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            tag => Err(DecodeError::BadTag { what, tag }),
        }
    }

    pub(super) fn memory(
        &mut self,
        what: &'static str,
    ) -> Result<Option<RemoteMemory>, DecodeError> {
        if !self.flag(what)? {
            return Ok(None);
        }
        Ok(Some(RemoteMemory {
            base: self.u64(what)?,
            size: self.u64(what)?,
            key: self.blob(what)?,
        }))
    }

    pub(super) fn placed(&mut self) -> Result<Option<Placed>, DecodeError> {
        if !self.flag("placed")? {
            return Ok(None);
        }
        let key = self.u64("placed.key")?;
        let count = self.u32("placed.runs")? as usize;
        if count > MAX_RUNS {
            return Err(DecodeError::TooLarge {
                what: "placed.runs",
                len: count,
                max: MAX_RUNS,
            });
        }
        // The items must be present before anything is allocated for them.
        let mut items = Reader::new(self.take(count * 8, "placed.runs")?);
        let mut runs = Vec::with_capacity(count);
        while !items.is_empty() {
            runs.push(items.u64("placed.runs")?);
        }
        Ok(Some(Placed { key, runs }))
    }

    pub(super) fn string(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let len = self.u16(what)? as usize;
        if len > MAX_STRING {
            return Err(DecodeError::TooLarge {
                what,
                len,
                max: MAX_STRING,
            });
        }
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(DecodeError::BadUtf8 { what }),
        }
    }

    pub(super) fn blob(&mut self, what: &'static str) -> Result<Vec<u8>, DecodeError> {
        let len = self.u32(what)? as usize;
        if len > MAX_AUX {
            return Err(DecodeError::TooLarge {
                what,
                len,
                max: MAX_AUX,
            });
        }
        Ok(self.take(len, what)?.to_vec())
    }

    pub(super) fn rooms(&mut self, what: &'static str) -> Result<Vec<u64>, DecodeError> {
        self.counted(what, MAX_HELD_ROOMS, 8, Reader::u64)
    }

    pub(super) fn pages(&mut self, what: &'static str) -> Result<Vec<u32>, DecodeError> {
        self.counted(what, MAX_PAGES, 4, Reader::u32)
    }

    pub(super) fn opt_pages(
        &mut self,
        what: &'static str,
    ) -> Result<Option<Vec<u32>>, DecodeError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.pages(what)?)),
            tag => Err(DecodeError::BadTag { what, tag }),
        }
    }

    /// A u32 count (at most `max`) of items of `size` bytes each, read by `item`.
    fn counted<T>(
        &mut self,
        what: &'static str,
        max: usize,
        size: usize,
        item: fn(&mut Reader<'a>, &'static str) -> Result<T, DecodeError>,
    ) -> Result<Vec<T>, DecodeError> {
        let count = self.u32(what)? as usize;
        if count > max {
            return Err(DecodeError::TooLarge {
                what,
                len: count,
                max,
            });
        }
        // The items must be present before anything is allocated for them.
        let bytes = self.take(count * size, what)?;
        let mut items = Reader::new(bytes);
        let mut out = Vec::with_capacity(count);
        while !items.is_empty() {
            out.push(item(&mut items, what)?);
        }
        Ok(out)
    }

    pub(super) fn ranks(&mut self) -> Result<Ranks, DecodeError> {
        Ok(Ranks {
            dp_rank: self.u32("ranks.dp_rank")?,
            dp_size: self.u32("ranks.dp_size")?,
            tp_rank: self.u32("ranks.tp_rank")?,
            tp_size: self.u32("ranks.tp_size")?,
            pp_rank: self.u32("ranks.pp_rank")?,
            pp_size: self.u32("ranks.pp_size")?,
        })
    }

    pub(super) fn layout(&mut self) -> Result<WireLayout, DecodeError> {
        Ok(WireLayout {
            kind: kind_from_tag(self.u8("layout.kind")?)?,
            dtype: dtype_from_tag(self.u8("layout.dtype")?)?,
            order: order_from_tag(self.u8("layout.order")?, "layout.order")?,
            num_layers: self.u32("layout.num_layers")?,
            num_kv_heads: self.u32("layout.num_kv_heads")?,
            head_dim: self.u32("layout.head_dim")?,
            page_size: self.u32("layout.page_size")?,
            heads: self.range("layout.heads")?,
            layers: self.range("layout.layers")?,
        })
    }
}

pub(super) fn role_tag(r: Role) -> u8 {
    match r {
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

pub(super) fn role_from_tag(tag: u8) -> Result<Role, DecodeError> {
    match tag {
        1 => Ok(Role::Prefill),
        2 => Ok(Role::Decode),
        _ => Err(DecodeError::BadTag { what: "role", tag }),
    }
}

pub(super) fn kind_tag(k: AttentionKind) -> u8 {
    match k {
        AttentionKind::Mha => 1,
        AttentionKind::Mla => 2,
    }
}

pub(super) fn kind_from_tag(tag: u8) -> Result<AttentionKind, DecodeError> {
    match tag {
        1 => Ok(AttentionKind::Mha),
        2 => Ok(AttentionKind::Mla),
        _ => Err(DecodeError::BadTag {
            what: "layout.kind",
            tag,
        }),
    }
}

pub(super) fn dtype_tag(d: Dtype) -> u8 {
    match d {
        Dtype::Bf16 => 1,
        Dtype::Fp16 => 2,
        Dtype::Fp8E4m3 => 3,
        Dtype::Fp8E5m2 => 4,
        Dtype::Fp32 => 5,
    }
}

pub(super) fn dtype_from_tag(tag: u8) -> Result<Dtype, DecodeError> {
    match tag {
        1 => Ok(Dtype::Bf16),
        2 => Ok(Dtype::Fp16),
        3 => Ok(Dtype::Fp8E4m3),
        4 => Ok(Dtype::Fp8E5m2),
        5 => Ok(Dtype::Fp32),
        _ => Err(DecodeError::BadTag {
            what: "layout.dtype",
            tag,
        }),
    }
}

pub(super) fn order_tag(o: PageOrder) -> u8 {
    match o {
        PageOrder::TokenMajor => 1,
        PageOrder::HeadMajor => 2,
        PageOrder::VllmCpuVec => 3,
        PageOrder::VllmCpuAmx => 4,
        PageOrder::VllmCpuVecSpan => 5,
    }
}

pub(super) fn order_from_tag(tag: u8, what: &'static str) -> Result<PageOrder, DecodeError> {
    match tag {
        1 => Ok(PageOrder::TokenMajor),
        2 => Ok(PageOrder::HeadMajor),
        3 => Ok(PageOrder::VllmCpuVec),
        4 => Ok(PageOrder::VllmCpuAmx),
        5 => Ok(PageOrder::VllmCpuVecSpan),
        _ => Err(DecodeError::BadTag { what, tag }),
    }
}

pub(super) fn code_from_tag(tag: u8) -> Result<FailureCode, DecodeError> {
    FailureCode::from_tag(tag).ok_or(DecodeError::BadTag { what: "code", tag })
}
