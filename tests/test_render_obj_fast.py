"""The OBJ reader's runs of plain lines, read by NumPy, against the reader of one line at a
time (tests/obj_reference.py): the same mesh, bit for bit, and the same warnings and errors
(text and line numbers) on generated files that mix every kind of statement, valid and not."""

from __future__ import annotations

import dataclasses
import random
import warnings

import pytest
import torch
from obj_reference import load_obj_reference

from mptex.render import obj
from mptex.render.obj import load_obj


def _fields(mesh) -> dict:
    """Every field of a mesh as (dtype, shape, bytes): equal only when bit for bit equal."""

    def bits(value):
        if isinstance(value, torch.Tensor):
            return (value.dtype, tuple(value.shape), value.contiguous().numpy().tobytes())
        return value

    found = {}
    for field in dataclasses.fields(mesh):
        value = getattr(mesh, field.name)
        if field.name == "materials" and value is not None:
            value = [{k: bits(v) for k, v in vars(m).items()} for m in value]
        found[field.name] = bits(value)
    return found


def _outcome(loader, path) -> tuple:
    """The mesh's fields or the error (type and text), and the warnings (type and text)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = _fields(loader(path))
        except Exception as exc:  # noqa: BLE001 - any exception is part of the outcome
            result = (type(exc).__name__, str(exc))
    return result, [(w.category.__name__, str(w.message)) for w in caught]


# Decimal spellings the readers must take alike: signs, no digits before or after the point,
# long mantissas, exponents at float32's and float64's ends (subnormal, overflow, underflow),
# and those that Python's float() accepts (underscores, nan, inf) or refuses (hex, ``e``).
_TRICKY = [
    "+1", "-0", "+0.0", ".5", "-.5", "5.", "+5.", "1e5", "1E+5", "1e-5", "1.e3", ".1e-3",
    "0.1000000000000000055511151231257827021181583404541015625", "3.4028234663852886e38",
    "3.4028235677973366e38", "3.4028236e38", "-3.4028234e38", "1e-45", "1.4e-45", "7e-46",
    "4.9406564584124654e-324", "2.4703282292062327e-324", "2.4703282292062328e-324",
    "1e-400", "1e400", "1.7976931348623157e308", "123456789012345678901234567890",
    "0.000000000000000000000000000000000000000000001401298464324817", "1_0", "nan", "-inf",
    "Infinity", "0x1p3", "1e", "e5", "--1", "+-1", "1.2.3", ".", "1e+", "1ee5", "١",
]  # fmt: skip


def _number(rng: random.Random) -> str:
    if rng.random() < 0.004:
        return rng.choice(_TRICKY)
    value = rng.uniform(-2, 2) * 10.0 ** rng.choice([0, 0, 0, 0, -3, 5, -40, 30])
    return rng.choice([f"{value:.6f}", repr(value), f"{value:.9g}", f"{value:.3e}"])


def _corner(rng: random.Random, form: str, counts: list[int]) -> str:
    def ref(count: int) -> str:
        roll = rng.random()
        if roll < 0.003:
            return rng.choice(["0", "-0", str(count + 1), str(-count - 1), "x", "+1", "1_0"])
        i = rng.randrange(max(count, 1))
        return str(i + 1) if rng.random() < 0.7 else str(i - count)

    p, t, n = (ref(c) for c in counts)
    return {"p": p, "pt": f"{p}/{t}", "ptn": f"{p}/{t}/{n}", "pn": f"{p}//{n}"}[form]


_ODD_LINES = [
    "# a comment", "", "   ", "g group", "o object", "s 1", "s off", "usemtl a", "usemtl b",
    "usemtl missing", "v 1 2", "v 1 2 3 1", "vt 0.5", "vt 0.5 0.5 0", "vn 0 0", "f 1 2",
    "f 1/ 2/ 3/", "f 1// 2// 3//", "f 1/1 2 3", "f 1 2 3 # a comment", " v 0 0 0",
    "v 0 0 0 \\", "f 1 2 \\", "vp 0.5", "l 1 2", "bogus 1 2", "f 1 2 3 4 5", "f 1 2 3 4 5 6",
    "\tf\t1\t2\t3", "v\t0\t1\t0", "f 1/1/1/1 2 3", "mtllib missing.mtl",
]  # fmt: skip


def _obj_text(rng: random.Random, odd: float) -> str:
    """An OBJ of runs of v, vt, vn lines, then runs of any kind (mostly f; each f line in one
    form, a triangle, a quad or a pentagon), with lines of ``_ODD_LINES`` sprinkled in (each
    line one with probability ``odd``), most lines ending with ``\\n`` or ``\\r\\n``."""
    lines = ["mtllib m.mtl"] if rng.random() < 0.7 else []
    counts = [0, 0, 0]
    kinds = ["v", "vt", "vn"] + [rng.choice(["v", "vt", "vn", "f", "f", "f"]) for _ in range(6)]
    for kind in kinds:
        run_form = rng.choice(["p", "pt", "ptn", "pn"])  # most lines of an f run share one
        for _ in range(rng.randint(1, 12)):
            if rng.random() < odd:
                lines.append(rng.choice(_ODD_LINES))
            elif kind in ("v", "vn"):
                lines.append(f"{kind} " + " ".join(_number(rng) for _ in range(3)))
                counts[0 if kind == "v" else 2] += 1
            elif kind == "vt":
                lines.append("vt " + " ".join(_number(rng) for _ in range(2)))
                counts[1] += 1
            else:
                form = run_form if rng.random() < 0.8 else rng.choice(["p", "pt", "ptn", "pn"])
                size = rng.choice([3, 3, 4, 4, 5])
                lines.append("f " + " ".join(_corner(rng, form, counts) for _ in range(size)))
        if rng.random() < 0.3:
            lines.append(rng.choice(["usemtl a", "usemtl b", "usemtl missing", "g part"]))
    # now and then a line break of str.splitlines' other than \n (a line of its own there)
    ends = ["\n"] * 20 + ["\r\n"] * 6 + ["\r", "\x85", "\u2028", "\x0c"]
    return "".join(line + rng.choice(ends) for line in lines)


def _write(tmp_path, text: str):
    (tmp_path / "m.mtl").write_text("newmtl a\nKd 0.2 0.4 0.6\nnewmtl b\nKd 0.9 0.1 0.1\n")
    path = tmp_path / "m.obj"
    path.write_bytes(text.encode())
    return path


@pytest.mark.parametrize("block", [1 << 20, 64])
def test_runs_match_the_reader_of_one_line_at_a_time(tmp_path, monkeypatch, block):
    # block 64: runs cut at many block ends, and continued statements across them
    monkeypatch.setattr(obj, "_LINES_BLOCK", block)
    rng = random.Random(20261201 + block)
    outcomes = {"mesh": 0, "error": 0}
    for case in range(300):
        text = _obj_text(rng, odd=rng.choice([0.0, 0.005, 0.03]))
        path = _write(tmp_path, text)
        expected = _outcome(load_obj_reference, path)
        assert _outcome(load_obj, path) == expected, (case, text)
        outcomes["mesh" if isinstance(expected[0], dict) else "error"] += 1
    assert min(outcomes.values()) > 50, outcomes  # both kinds of outcome are exercised


def test_tricky_numbers_read_alike_in_runs(tmp_path):
    # Each spelling in a run of plain lines, where NumPy reads it, and the same outcome as
    # the reader of one line at a time: a value, or the error of that line.
    for spelling in _TRICKY:
        for line in (f"v 0 {spelling} 0", f"vt {spelling} 0.5", f"vn 0 0 {spelling}"):
            text = (
                "v 0 0 0\nv 1 0 0\nv 0 1 0\nvt 0 0\nvn 0 0 1\n" + line + "\nf 1/1/1 2/1/1 3/1/1\n"
            )
            path = _write(tmp_path, text)
            assert _outcome(load_obj, path) == _outcome(load_obj_reference, path), line


def _grid(rng: random.Random, cells: int) -> str:
    """A textured height field of ``cells`` x ``cells`` quads, half of them written as two
    triangles, with two materials, every index form and relative indices in one run."""
    side = cells + 1
    lines = ["mtllib m.mtl"]
    for j in range(side):
        lines += [
            f"v {i / cells:.6f} {j / cells:.6f} {rng.uniform(0, 0.01):.6f}" for i in range(side)
        ]
    lines += [f"vt {i / cells:.6f} {j / cells:.6f}" for j in range(side) for i in range(side)]
    lines += ["vn 0 0 1"] * (side * side)
    n = side * side
    for j in range(cells):
        lines.append("usemtl a" if j % 2 else "usemtl b")
        form = ["{0}/{0}/{0}", "{0}//{0}", "{0}/{0}", "{0}", "{1}/{1}/{1}"][j % 5]
        for i in range(cells):
            a = j * side + i + 1
            b, d, e = a + 1, a + side, a + side + 1

            def c(k: int, form: str = form) -> str:
                return form.format(k, k - 1 - n)  # {1}: the same vertex, counted back

            if i % 2:
                lines.append(f"f {c(a)} {c(b)} {c(e)} {c(d)}")
            else:
                lines += [f"f {c(a)} {c(b)} {c(e)}", f"f {c(a)} {c(e)} {c(d)}"]
    return "\n".join(lines) + "\n"


def test_a_regular_file_is_read_in_runs_not_line_by_line(tmp_path, monkeypatch):
    # Counts Python's work, not time: the lines that come one at a time to the reader, the
    # runs, and the calls of the per-line number and index parsers.
    cells = 60
    path = _write(tmp_path, _grid(random.Random(0), cells))
    calls = {"statements": 0, "runs": 0, "_floats": 0, "_index": 0, "_triangulate": 0}

    original = getattr(obj, "_pieces", None)

    def pieces(text, runs):
        for piece in original(text, runs):
            calls["runs" if piece[2] is not None else "statements"] += 1
            yield piece

    def counted(name):
        parse = getattr(obj, name)

        def spy(*args):
            calls[name] += 1
            return parse(*args)

        return spy

    expected = _outcome(load_obj_reference, path)
    monkeypatch.setattr(obj, "_pieces", pieces, raising=False)
    for name in ("_floats", "_index", "_triangulate"):
        monkeypatch.setattr(obj, name, counted(name))
    assert _outcome(load_obj, path) == expected
    # 1 mtllib and one usemtl per grid row come one at a time, and the MTL's 4 lines (its
    # 2 Kd through _floats); the 16,000 v, vt, vn and f lines come as one run per kind and
    # per grid row, and the planar quads are split into their fans without _triangulate.
    assert calls == {
        "statements": 1 + cells + 4, "runs": 3 + cells, "_floats": 2, "_index": 0,
        "_triangulate": 0,
    }  # fmt: skip
