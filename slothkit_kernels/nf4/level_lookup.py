"""Sixteen levels (fp32, or bf16/fp16) looked up in registers by PTX byte permutes, for
4-bit codes.

A dequantising GEMV turns each 4-bit code into its level.  A load from a table (global
memory or shared) is a gather across the warp, one load instruction per code or pair of
codes, and on the H200 such loads bound nf4_gemv far below the memory's bandwidth.  This
is the lookup done in integer instructions instead, with the table held in the
instructions (as immediates) and in registers.

``prmt.b32 d, a, b, c`` builds d from four bytes of the eight in {b, a}: output byte i
is byte ``c[4i+2 : 4i]`` of ``(b << 32) | a``, or, when ``c[4i+3]`` is set, that byte's
sign bit copied into all eight bits; only c's low 16 bits are read.  So with one byte
of every level per table word -- plane p, words T[p][0..3], holding byte p of levels
0-3, 4-7, 8-11 and 12-15 -- and four codes as c's four nibbles:

    lo = prmt(T[p][0], T[p][1], c)            right where a code is 0-7 (bit 3 clear)
    hi = prmt(T[p][2], T[p][3], c ^ 0x8888)   right where a code is 8-15 (bit 3 flipped)
    byte p of the four levels = lo where bit 3 is clear, else hi:  one lop3 with a mask

A packed byte holds two codes (the high nibble first in the weight's order, the low one
second), so a 32-bit word of four packed bytes holds eight, as c = the word's low 16
bits (low nibble of byte 0, high nibble of byte 0, low of byte 1, high of byte 1) and
c = its high 16 bits.  The masks come without arithmetic: a code's bit 3 is the sign bit
of a byte of the word (a high nibble) or of the word shifted left by four (a low one),
which prmt's sign mode spreads over a byte.  Four planes give byte p of the four levels
in a word each; a 4x4 byte transpose (eight prmt) makes them four fp32 levels.

Per word of eight codes: 6 instructions of selectors and masks, 24 of lookups (3 per
plane per four codes), 16 of transpose: 46, under six per code, every one an integer
instruction, against one table load per code (or per pair) that the warp's spread of
addresses serialises.  The levels come out bit for bit.  Levels of 16 bits (bf16,
rounded to nearest from the fp32 levels, or fp16) need two planes and two permutes per
four codes to pair them: 22 instructions a word, for a GEMV that multiplies in 16 bits.

The other lookup here fetches each level from another lane of the warp.  Lane l holds
level l mod 16 in a register, and ``shfl.sync.idx d, a, b`` gives every lane the ``a`` of
lane ``b mod 32``: a code is the low four bits of b, and the fifth (the next nibble's
lowest bit) picks between two copies of the same table.  So the word itself, and the
word shifted right by 4, 8, ..., 28, index the eight levels: 7 shifts and 8 shuffles a
word, under two instructions a code, against the permutes' 46.  A shuffle is not an
integer instruction but goes to the SM's memory pipe (32 lanes a clock on sm_80 and
sm_90, as a shared-memory load), and the levels come out bit for bit, at 32 bits or, with
a permute per pair, at 16.  Every lane of the warp must run each shuffle, which the
straight-line loops that call these do.

``lookup_program`` and ``shuffle_program`` give the instructions as data (tests run them
through an interpreter of their PTX semantics); ``lookup_asm`` and ``shuffle_asm``
render them for ``tl.inline_asm_elementwise`` with ``pack=4`` over uint8 codes
(``operands`` lists what $0, $1, ... are: the outputs, the word, the table words in
registers; the shuffle reads only the first).
"""

from __future__ import annotations

import functools
import struct

import triton
import triton.language as tl

# An instruction: (opcode, destination, *operands); an operand is a register name or an
# int immediate.  Opcodes: "prmt" (d, a, b, c), "lop3" (d, a, b, c, lut), "shl"/"shr"
# (d, a, bits), "xor" (d, a, imm), "shfl.sync.idx" (d, a, lane, SHUFFLE_CLAMP,
# SHUFFLE_MEMBERS).  Registers named here are the asm's operands (in
# ``operands``' order); other names are temporaries.
Instruction = tuple

WORD = "word"  # the four packed bytes
# A SASS PRMT takes one of its two sources as an immediate; the other must be a register.
# So half the table (words 0 and 2 of every plane) is passed in, ``register_words``
# loaded once per program, and the asm names them: with pack=4 each 32-bit operand
# arrives four times (one per element), and the first of each four is used.
WIDTHS = (32, 16)  # bits of a level: fp32, or the 16-bit dtype the GEMV multiplies in
# shfl.sync's c operand: clamp 31 and no segment mask, so the source lane is b[4:0];
# every lane of the warp takes part.
SHUFFLE_CLAMP, SHUFFLE_MEMBERS = 0x1F, 0xFFFFFFFF


def outputs(width: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The output registers: (the high nibbles' levels, the low nibbles'), for bytes 0-3
    in order: one register a level at 32 bits, two levels a register (byte 2i's in the low
    half, byte 2i + 1's in the high) at 16."""
    if width == 32:
        return tuple(f"high{i}" for i in range(4)), tuple(f"low{i}" for i in range(4))
    return ("high01", "high23"), ("low01", "low23")


def nibble_outputs() -> tuple[str, ...]:
    """The 32-bit output register of each of a word's eight nibbles, lowest first: the low
    nibble of byte i // 2 for even i, its high nibble for odd i."""
    high, low = outputs(32)
    return tuple(low[i // 2] if i % 2 == 0 else high[i // 2] for i in range(8))


def table_registers(width: int) -> tuple[str, ...]:
    """The table words passed in registers: words (plane p, 0) and (p, 2) as t2p, t2p+1."""
    return tuple(f"t{i}" for i in range(width // 4))


def operands(width: int) -> tuple[str, ...]:
    """The asm's operands, $0 onwards: the outputs, the word, then each table register
    (four operands each, one per packed element)."""
    high, low = outputs(width)
    tables = [name for name in table_registers(width) for _ in range(4)]
    return (*high, *low, WORD, *tables)


def constraints(width: int) -> str:
    high, low = outputs(width)
    return ",".join(["=r"] * (len(high) + len(low)) + ["r"] * (len(operands(width)) - len(high) - len(low)))


# lop3's truth table for (a & ~c) | (b & c): a = 0xF0, b = 0xCC, c = 0xAA.
SELECT_BY_MASK = (0xF0 & ~0xAA | 0xCC & 0xAA) & 0xFF
# Byte transpose: interleave bytes 0-1 (or 2-3) of two words, then join half-words.
INTERLEAVE_LOW, INTERLEAVE_HIGH = 0x5140, 0x7362
JOIN_LOW, JOIN_HIGH = 0x5410, 0x7632
# Two 16-bit levels a word from planes 0 and 1 (codes in nibble order low 0, high 0,
# low 1, high 1): the high nibbles' are bytes 1 and 3 of each plane, the low ones' 0 and 2.
PAIR_HIGH, PAIR_LOW = 0x7351, 0x6240
# Sign-mode selectors (bit 3 set) of the byte holding each code's bit 3, where a = the
# word and b = the word << 4: codes (low 0, high 0, low 1, high 1) are the sign bits of
# (b byte 0, a byte 0, b byte 1, a byte 1); for bytes 2-3 the same, two bytes on.
MASK_SELECTORS = (0x9D8C, 0xBFAE)


def level_bits(levels, width: int = 32, dtype: str = "bfloat16") -> list[int]:
    """The bit patterns of 16 levels: fp32, or at 16 bits ``dtype`` ("bfloat16", rounded
    to nearest even from fp32, or "float16")."""
    levels = [float(v) for v in levels]
    if len(levels) != 16:
        raise ValueError(f"a 4-bit code has 16 levels, got {len(levels)}")
    fp32 = [struct.unpack("<I", struct.pack("<f", v))[0] for v in levels]
    if width == 32:
        return fp32
    if dtype == "float16":
        return [struct.unpack("<H", struct.pack("<e", v))[0] for v in levels]
    return [(b + 0x7FFF + ((b >> 16) & 1)) >> 16 for b in fp32]  # NF4 levels are finite


def table_words(bits: list[int], width: int) -> list[list[int]]:
    """words[p][q]: byte p of levels 4q .. 4q + 3, level 4q + i in byte i."""
    return [
        [sum(((bits[4 * q + i] >> (8 * p)) & 0xFF) << (8 * i) for i in range(4)) for q in range(4)]
        for p in range(width // 8)
    ]


def register_words(levels, width: int = 32, dtype: str = "bfloat16") -> list[int]:
    """The table words passed in registers, in the order of ``table_registers``."""
    words = table_words(level_bits(levels, width, dtype), width)
    return [words[p][q] for p in range(width // 8) for q in (0, 2)]


def lookup_program(levels, width: int = 32, dtype: str = "bfloat16") -> tuple[Instruction, ...]:
    """The instructions turning WORD's eight codes into their levels (``outputs``)."""
    if width not in WIDTHS:
        raise ValueError(f"levels of {width} bits; supported: {WIDTHS}")
    words = table_words(level_bits(levels, width, dtype), width)
    tables = table_registers(width)
    program = [
        ("shl", "w4", WORD, 4),
        ("shr", "c1", WORD, 16),
        ("xor", "x0", WORD, 0x8888),
        ("xor", "x1", "c1", 0x8888),
        ("prmt", "m0", WORD, "w4", MASK_SELECTORS[0]),
        ("prmt", "m1", WORD, "w4", MASK_SELECTORS[1]),
    ]
    high, low = outputs(width)
    # Half h covers bytes 2h and 2h + 1; its four codes in nibble order are
    # (low 2h, high 2h, low 2h + 1, high 2h + 1), which the words built below follow.
    for h, (codes, flipped, mask) in enumerate(((WORD, "x0", "m0"), ("c1", "x1", "m1"))):
        for p in range(width // 8):
            program += [
                ("prmt", "lo", tables[2 * p], words[p][1], codes),
                ("prmt", "hi", tables[2 * p + 1], words[p][3], flipped),
                ("lop3", f"p{p}", "lo", "hi", mask, SELECT_BY_MASK),
            ]
        if width == 16:
            program += [("prmt", high[h], "p0", "p1", PAIR_HIGH), ("prmt", low[h], "p0", "p1", PAIR_LOW)]
            continue
        in_order = (low[2 * h], high[2 * h], low[2 * h + 1], high[2 * h + 1])
        program += [
            ("prmt", "u0", "p0", "p1", INTERLEAVE_LOW),
            ("prmt", "u1", "p0", "p1", INTERLEAVE_HIGH),
            ("prmt", "v0", "p2", "p3", INTERLEAVE_LOW),
            ("prmt", "v1", "p2", "p3", INTERLEAVE_HIGH),
            ("prmt", in_order[0], "u0", "v0", JOIN_LOW),
            ("prmt", in_order[1], "u0", "v0", JOIN_HIGH),
            ("prmt", in_order[2], "u1", "v1", JOIN_LOW),
            ("prmt", in_order[3], "u1", "v1", JOIN_HIGH),
        ]
    return tuple(program)


def shuffle_words(levels, width: int = 32, dtype: str = "bfloat16") -> list[int]:
    """The table words the shuffle lookup takes in registers, lane by lane, as many a lane
    as ``table_registers``: lane l's first holds level l mod 16 (its bits in the low half
    at 16 bits), the others 0 (not read)."""
    bits = level_bits(levels, width, dtype)
    unread = [0] * (len(table_registers(width)) - 1)
    return [word for lane in range(32) for word in [bits[lane % 16], *unread]]


def shuffle_program(width: int = 32) -> tuple[Instruction, ...]:
    """The instructions turning WORD's eight codes into their levels (``outputs``) by
    shuffles of the first table register (``shuffle_words``).  The word is read only
    before the first output is written."""
    if width not in WIDTHS:
        raise ValueError(f"levels of {width} bits; supported: {WIDTHS}")
    table = table_registers(width)[0]
    # Nibble i of the word (low nibble of byte i // 2 for even i, its high one for odd).
    nibbles = [WORD] + [f"s{i}" for i in range(1, 8)]
    program = [("shr", nibbles[i], WORD, 4 * i) for i in range(1, 8)]
    high, low = outputs(width)
    if width == 32:
        fetched = nibble_outputs()
    else:
        fetched = [f"{'low' if i % 2 == 0 else 'high'}_{i // 2}" for i in range(8)]
    program += [
        ("shfl.sync.idx", fetched[i], table, nibbles[i], SHUFFLE_CLAMP, SHUFFLE_MEMBERS) for i in range(8)
    ]
    if width == 16:  # byte 2i's level in the low half of a register, byte 2i + 1's in the high
        for h in range(2):
            program += [
                ("prmt", high[h], f"high_{2 * h}", f"high_{2 * h + 1}", JOIN_LOW),
                ("prmt", low[h], f"low_{2 * h}", f"low_{2 * h + 1}", JOIN_LOW),
            ]
    return tuple(program)


@functools.lru_cache(maxsize=8)
def lookup_asm(levels: tuple[float, ...], width: int = 32, dtype: str = "bfloat16") -> str:
    """PTX for ``tl.inline_asm_elementwise(lookup_asm(...), constraints(width), [codes,
    *table words], dtype=(level dtype,) * 2, is_pure=True, pack=4)`` over uint8 codes."""
    return _render(lookup_program(levels, width, dtype), width)


@functools.lru_cache(maxsize=2)
def shuffle_asm(width: int = 32) -> str:
    """PTX of the shuffle lookup, called as ``lookup_asm``'s with ``shuffle_words`` for
    the table words; the same for every table (the levels are all in registers)."""
    return _render(shuffle_program(width), width)


def _render(program: tuple[Instruction, ...], width: int) -> str:
    numbered = {}
    for i, name in enumerate(operands(width)):
        numbered.setdefault(name, f"${i}")  # a table register's first of its four

    def operand(value) -> str:
        return f"{value:#010x}" if isinstance(value, int) else numbered.get(value, f"%{value}")

    temporaries = sorted({ins[1] for ins in program if ins[1] not in numbered})
    lines = [".reg .b32 " + ", ".join(f"%{t}" for t in temporaries) + ";"]
    for opcode, *arguments in program:  # lop3's truth table is its last operand, as in PTX
        lines.append(f"{opcode}.b32 {', '.join(operand(a) for a in arguments)};")
    return "{\n" + "\n".join(lines) + "\n}"


@triton.jit
def lane():
    """This thread's lane in its warp, which ptxas cannot know to be the same anywhere.
    Table words read at a per-lane address (a copy per lane) stay in ordinary registers,
    which PRMT reads; a value ptxas knows to be uniform goes to a uniform register and is
    copied out at every lookup."""
    return tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
