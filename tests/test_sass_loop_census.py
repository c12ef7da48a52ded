"""scripts/sass_loop_census.py on hand-written SASS: loops found by their backward branches, the
innermost ones kept, the main loop chosen by its exponentials (CPU only, no compiler)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_loop_census.py"
spec = importlib.util.spec_from_file_location("sass_loop_census", SCRIPT)
census = importlib.util.module_from_spec(spec)
spec.loader.exec_module(census)

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/                   FFMA R2, R3, R4, R5 ;
        /*0030*/              @P0  BRA 0x10 ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0050*/                   MUFU.EX2 R6, R7 ;
        /*0060*/                   MUFU.EX2 R8, R9 ;
        /*0070*/                   FMUL R2, R3, R4 ;
        /*0080*/                   IADD3 R2, R3, 0x1, RZ ;
        /*0090*/              @!P1 BRA 0x40 ;
        /*00a0*/                   IMAD R2, R3, R4, R5 ;
        /*00b0*/                   BRA 0x0 ;
        /*00c0*/                   EXIT ;
"""


def test_innermost_loops_by_backward_branches():
    bodies = census.loops(SASS)
    assert [len(b) for b in bodies] == [3, 6]  # the outer loop 0x0..0xb0 holds both and is dropped
    assert bodies[0][0].startswith("HGMMA") and bodies[0][-1] == "BRA"


def test_main_loop_is_the_one_with_the_exponentials():
    row = census.main_loop(SASS)
    assert row == {"instructions": 6, "MUFU": 2, "FP32": 1, "INT": 1, "MOV": 0, "CVT": 0, "HGMMA": 1}


def test_every_tensor_core_loop_in_address_order():
    rows = census.tensor_core_loops(SASS)
    assert [row["instructions"] for row in rows] == [3, 6] and rows[1] == census.main_loop(SASS)


def test_no_tensor_core_loop_is_an_error():
    with pytest.raises(ValueError, match="no loop with HGMMA"):
        census.main_loop("/*0000*/ FFMA R2, R3, R4, R5 ;\n/*0010*/ BRA 0x0 ;")
