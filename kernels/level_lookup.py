"""Sixteen fp32 levels looked up in registers by PTX byte permutes, for 4-bit codes.

A dequantising GEMV turns each 4-bit code into its level.  A load from a table (global
memory or shared) is a gather across the warp, one load instruction per code or pair of
codes, and on the H200 such loads bound nf4_gemv far below the memory's bandwidth.  This
is the lookup done in ALU instructions instead, with the table held as immediates.

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
plane per four codes), 16 of transpose: 46, under six per code, every one a full-rate
integer instruction on sm_80 and later, against one table load per code (or per pair)
that the warp's spread of addresses serialises.  The levels come out bit for bit.

``lookup_program`` gives the instructions as data (tests run them through an
interpreter of their PTX semantics); ``lookup_asm`` renders them for
``tl.inline_asm_elementwise`` with ``pack=4`` over uint8 codes: $0-$3 the high nibbles'
levels of bytes 0-3, $4-$7 the low nibbles', $8 the four bytes.
"""

from __future__ import annotations

import functools
import struct

# An instruction: (opcode, destination, *operands); an operand is a register name or an
# int immediate.  Opcodes: "prmt" (d, a, b, c), "lop3" (d, a, b, c, lut), "shl"/"shr"
# (d, a, bits), "xor" (d, a, imm).
Instruction = tuple

WORD = "$8"  # the four packed bytes
HIGH_LEVELS = ("$0", "$1", "$2", "$3")  # NF4[byte i >> 4]: the even columns' levels
LOW_LEVELS = ("$4", "$5", "$6", "$7")  # NF4[byte i & 15]: the odd columns'
# A SASS PRMT takes one of its two sources as an immediate; the other must be a register.
# So half the table (words 0 and 2 of every plane) is passed in, ``register_words``
# loaded once per program, and the asm names them: with pack=4 each 32-bit operand
# arrives four times (one per element), and the first of each four is used.
TABLE_REGISTERS = tuple(f"t{i}" for i in range(8))  # words (plane p, 0) and (p, 2) as t2p, t2p+1
CONSTRAINTS = ",".join(["=r"] * 8 + ["r"] + ["r"] * 4 * len(TABLE_REGISTERS))

# lop3's truth table for (a & ~c) | (b & c): a = 0xF0, b = 0xCC, c = 0xAA.
SELECT_BY_MASK = (0xF0 & ~0xAA | 0xCC & 0xAA) & 0xFF
# Byte transpose: interleave bytes 0-1 (or 2-3) of two words, then join half-words.
INTERLEAVE_LOW, INTERLEAVE_HIGH = 0x5140, 0x7362
JOIN_LOW, JOIN_HIGH = 0x5410, 0x7632
# Sign-mode selectors (bit 3 set) of the byte holding each code's bit 3, where a = the
# word and b = the word << 4: codes (low 0, high 0, low 1, high 1) are the sign bits of
# (b byte 0, a byte 0, b byte 1, a byte 1); for bytes 2-3 the same, two bytes on.
MASK_SELECTORS = (0x9D8C, 0xBFAE)


def level_bits(levels) -> list[int]:
    """The fp32 bit patterns of 16 levels."""
    levels = [float(v) for v in levels]
    if len(levels) != 16:
        raise ValueError(f"a 4-bit code has 16 levels, got {len(levels)}")
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in levels]


def table_words(levels) -> list[list[int]]:
    """words[p][q]: byte p of levels 4q .. 4q + 3, level 4q + i in byte i."""
    bits = level_bits(levels)
    return [
        [sum(((bits[4 * q + i] >> (8 * p)) & 0xFF) << (8 * i) for i in range(4)) for q in range(4)]
        for p in range(4)
    ]


def register_words(levels) -> list[int]:
    """The table words passed in registers, in the order of ``TABLE_REGISTERS``."""
    words = table_words(levels)
    return [words[p][q] for p in range(4) for q in (0, 2)]


def lookup_program(levels) -> tuple[Instruction, ...]:
    """The instructions turning WORD's eight codes into HIGH_LEVELS and LOW_LEVELS."""
    words = table_words(levels)
    program = [
        ("shl", "w4", WORD, 4),
        ("shr", "c1", WORD, 16),
        ("xor", "x0", WORD, 0x8888),
        ("xor", "x1", "c1", 0x8888),
        ("prmt", "m0", WORD, "w4", MASK_SELECTORS[0]),
        ("prmt", "m1", WORD, "w4", MASK_SELECTORS[1]),
    ]
    selectors = ((WORD, "x0", "m0"), ("c1", "x1", "m1"))
    # Half h covers bytes 2h and 2h + 1; its four codes in nibble order are
    # (low 2h, high 2h, low 2h + 1, high 2h + 1), which the transpose's words follow.
    outputs = ((LOW_LEVELS[0], HIGH_LEVELS[0], LOW_LEVELS[1], HIGH_LEVELS[1]),
               (LOW_LEVELS[2], HIGH_LEVELS[2], LOW_LEVELS[3], HIGH_LEVELS[3]))  # fmt: skip
    for h, (codes, flipped, mask) in enumerate(selectors):
        for p in range(4):
            program += [
                ("prmt", "lo", TABLE_REGISTERS[2 * p], words[p][1], codes),
                ("prmt", "hi", TABLE_REGISTERS[2 * p + 1], words[p][3], flipped),
                ("lop3", f"p{p}", "lo", "hi", mask, SELECT_BY_MASK),
            ]
        program += [
            ("prmt", "u0", "p0", "p1", INTERLEAVE_LOW),
            ("prmt", "u1", "p0", "p1", INTERLEAVE_HIGH),
            ("prmt", "v0", "p2", "p3", INTERLEAVE_LOW),
            ("prmt", "v1", "p2", "p3", INTERLEAVE_HIGH),
            ("prmt", outputs[h][0], "u0", "v0", JOIN_LOW),
            ("prmt", outputs[h][1], "u0", "v0", JOIN_HIGH),
            ("prmt", outputs[h][2], "u1", "v1", JOIN_LOW),
            ("prmt", outputs[h][3], "u1", "v1", JOIN_HIGH),
        ]
    return tuple(program)


def _operand(value) -> str:
    if isinstance(value, int):
        return f"{value:#010x}"
    if value in TABLE_REGISTERS:  # after the outputs and WORD, four operands each
        return f"${9 + 4 * TABLE_REGISTERS.index(value)}"
    return value if value.startswith("$") else f"%{value}"


@functools.lru_cache(maxsize=8)
def lookup_asm(levels: tuple[float, ...]) -> str:
    """PTX for ``tl.inline_asm_elementwise(lookup_asm(...), CONSTRAINTS, [codes],
    dtype=(tl.float32, tl.float32), is_pure=True, pack=4)`` over uint8 codes."""
    program = lookup_program(levels)
    temporaries = sorted({ins[1] for ins in program if not ins[1].startswith("$")})
    lines = [".reg .b32 " + ", ".join(f"%{t}" for t in temporaries) + ";"]
    for opcode, *operands in program:  # lop3's truth table is its last operand, as in PTX
        lines.append(f"{opcode}.b32 {', '.join(_operand(o) for o in operands)};")
    return "{\n" + "\n".join(lines) + "\n}"
