"""scripts/mutants.py's generator (scripts/mutants_gen.py), on a small source string: its
operators, what it leaves alone, and the same draw for the same seed."""

from __future__ import annotations

import ast
from types import ModuleType

import pytest
from script_modules import load_script

SOURCE = '''\
"""A docstring with 1 < 2 in it."""
import logging

log = logging.getLogger(__name__)
LIMIT = 3


def pick(a: int, b: list[int], flag: bool = True) -> int:
    """Pick one."""
    assert a >= 0
    log.debug("a is %d", a + 1)
    if a < LIMIT and a not in b:
        return a - 1
    while not flag:
        flag = a is None or False
    return f"{a + 1}" and 0


class Box:
    def __repr__(self) -> str:
        return str(1 if self else 2)
'''


@pytest.fixture(scope="module")
def mutants() -> ModuleType:
    module: ModuleType = load_script("mutants_gen")
    return module


def test_every_operator_is_found_and_nothing_it_must_skip(mutants: ModuleType) -> None:
    found = mutants.find_mutants(SOURCE, "llamax/grammar_x.py", "grammar")
    changes = {(m.line, m.operator, m.original, m.replacement) for m in found}
    assert changes == {
        (5, "int", "3", "4"),
        (8, "bool", "True", "False"),
        (12, "negate_condition", "a < LIMIT and a not in b", "not (a < LIMIT and a not in b)"),
        (12, "compare", "<", "<="),
        (12, "and_or", "and", "or"),
        (12, "compare", "not in", "in"),
        (13, "add_sub", "-", "+"),
        (13, "int", "1", "2"),
        (14, "negate_condition", "not flag", "not (not flag)"),
        (14, "drop_not", "not ", ""),
        (15, "compare", "is", "is not"),
        (15, "and_or", "or", "and"),
        (15, "bool", "False", "True"),
        (16, "and_or", "and", "or"),
        (16, "int", "0", "1"),
    }  # not the docstring, the annotations, the assert, the log call, the f-string, __repr__


def test_each_mutant_applies_to_its_text_and_compiles(mutants: ModuleType) -> None:
    for mutant in mutants.find_mutants(SOURCE, "llamax/grammar_x.py", "grammar"):
        mutated = mutants.apply(SOURCE, mutant)
        assert ast.dump(ast.parse(mutated)) != ast.dump(ast.parse(SOURCE))
        assert mutated.splitlines()[mutant.line - 1].count(mutant.replacement) >= 1


def test_the_draw_is_the_same_for_a_seed_and_per_area(mutants: ModuleType) -> None:
    sources = {
        "llamax/grammar_x.py": SOURCE,
        "llamax/engine/kv/prefix_ram.py": SOURCE,
        "llamax/openai/x.py": SOURCE,
        "llamax/engine/x.py": SOURCE,
        "llamax/cli.py": SOURCE,  # in no area
    }
    first = mutants.generate(sources, 7, 5)
    assert first == mutants.generate(sources, 7, 5)
    assert [m.area for m in first] == [a for a in mutants.AREAS for _ in range(5)]
    assert first != mutants.generate(sources, 8, 5)
    assert len({m.id for m in first}) == len(first)


def test_the_areas_name_their_files(mutants: ModuleType) -> None:
    assert mutants.area_of("llamax/engine/kv/prefix_disk.py") == "tiers"
    assert mutants.area_of("llamax/engine/kv/kvcache.py") == "engine"
    assert mutants.area_of("llamax/server/llama/slots.py") == "dialects"
    assert mutants.area_of("llamax/server/dialects.py") == "dialects"
    assert mutants.area_of("llamax/grammar_numbers/digits.py") == "grammar"
    assert mutants.area_of("llamax/grammar_json.py") == "grammar"
    assert mutants.area_of("llamax/server/app.py") is None


def test_a_node_id_names_its_junit_case(mutants: ModuleType) -> None:
    key = load_script("mutants_map").nodeid_key("tests/test_a.py::TestB::test_c[x-1]")
    assert key == "tests.test_a.TestB.test_c[x-1]"


def test_module_constants_and_defaults_run_at_import(mutants: ModuleType) -> None:
    found = mutants.find_mutants(SOURCE, "llamax/grammar_x.py", "grammar")
    at_import = {m.line for m in found if mutants.runs_at_import(SOURCE, m)}
    assert at_import == {5, 8}  # LIMIT = 3; flag: bool = True
