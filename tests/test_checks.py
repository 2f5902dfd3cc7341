"""Answer checks (`bench/checks.py`) on hand-made answers, and the shipped checkable prompt sets."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from early_exit_router.bench.checks import (
    CHECKS,
    check_answer,
    check_contains,
    check_json,
    check_number,
    check_python,
    check_sequence,
    numbers_in,
    validate_check,
)
from early_exit_router.training.corpus import load_prompts

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WEEK = {"kind": "sequence", "items": DAYS}
CHECKABLE = ("checkable_prompts.jsonl", "checkable_heldout_prompts.jsonl")


def test_a_sequence_holds_every_item_once_in_order():
    right = "The seven days of the week are:\n\n1. Monday\n2. Tuesday\n3. Wednesday\n4. Thursday\n5. Friday\n"
    assert check_sequence(WEEK, right + "6. Saturday\n7. Sunday")
    assert check_answer(WEEK, "monday, tuesday, wednesday, thursday, friday, saturday and sunday")  # any case
    # exit mode's failure: an item repeated, and so the last one pushed off the list
    assert not check_sequence(WEEK, "1. Monday 2. Monday 3. Tuesday 4. Wednesday 5. Thursday 6. Friday 7. Saturday")
    assert not check_sequence(WEEK, "1. Monday 2. Monday 3. Tuesday 4. Wednesday 5. Thursday 6. Friday 7. Saturday "
                                    "8. Sunday")  # fmt: skip
    assert not check_sequence(WEEK, "Monday Tuesday Thursday Wednesday Friday Saturday Sunday")  # out of order
    assert not check_sequence(WEEK, "Monday Tuesday Wednesday Thursday Friday Saturday")  # one missing (cut off)
    assert not check_sequence(WEEK, "Mondays Tuesday Wednesday Thursday Friday Saturday Sunday")  # whole words only
    assert not check_sequence(WEEK, "")
    numbers = {"kind": "sequence", "items": [str(i) for i in range(1, 21)]}
    assert check_sequence(numbers, ", ".join(str(i) for i in range(1, 21)))
    assert not check_sequence(numbers, "".join(str(i) for i in range(1, 21)))  # "1234...": no number on its own
    roman = {"kind": "sequence", "items": ["I", "II", "III", "IV", "V"], "case_sensitive": True}
    assert check_sequence(roman, "I, II, III, IV, V")  # "I" is not found inside "II", nor "V" inside "IV"
    assert not check_sequence(roman, "i, ii, iii, iv, v")  # case-sensitive where the check says so
    phrase = {"kind": "sequence", "items": ["North America", "South America"]}
    assert check_sequence(phrase, "North\nAmerica and South America")  # a phrase across any white space


def test_contains_wants_every_string_of_all_and_one_of_any():
    check = {"kind": "contains", "all": ["maria.lopez@example.org"]}
    assert check_contains(check, "Her address is maria.lopez@example.org.")
    assert not check_contains(check, "Her address is maria.lopez@example.com.")
    assert not check_contains(check, "xmaria.lopez@example.org")  # not inside a longer word
    colours = {"kind": "contains", "all": ["red", "blue"], "any": ["yellow", "green"]}
    assert check_contains(colours, "Red, Blue and Yellow.")
    assert not check_contains(colours, "Red and Blue.") and not check_contains(colours, "Reddish, blue, green")
    assert check_answer({"kind": "contains", "any": ["Paris"]}, "The capital of France is Paris.")


def test_a_number_counts_where_it_stands_on_its_own():
    assert numbers_in("17 + 25 = 42. Then 1,024 items, 4.2 kg, -3 degrees, 12.5% and v2.") == [
        17.0, 25.0, 42.0, 1024.0, 4.2, -3.0, 12.5,
    ]  # fmt: skip
    check = {"kind": "number", "value": 42}
    assert check_number(check, "17 + 25 = 42.") and check_number(check, "The answer is 42.0")
    assert not check_number(check, "17 + 25 = 32.") and not check_number(check, "420 or 4.2 or 142")
    assert check_number({"kind": "number", "value": 1024}, "1,024")
    assert check_number({"kind": "number", "value": 0}, "0")
    assert check_answer({"kind": "number", "value": 2.5}, "It takes 2.5 hours.")


def test_json_parses_from_a_fence_or_the_text_and_holds_its_keys():
    check = {"kind": "json", "keys": ["name", "age"]}
    assert check_json(check, 'Here it is:\n```json\n{"name": "Ann", "age": 30}\n```\nDone.')
    assert check_json(check, 'Sure! {"name": "Ann", "age": 30, "city": "Oslo"} is one.')  # no fence
    assert not check_json(check, '{"name": "Ann"}')  # a key missing
    assert not check_json(check, '{"name": "Ann", "age": 30')  # cut off
    assert not check_json(check, "{'name': 'Ann', 'age': 30}")  # Python, not JSON
    assert not check_json(check, "No JSON here.")
    rows = '[{"name": "Ann", "age": 30}, {"name": "Bo", "age": 4}]'
    assert check_json(check, rows) and not check_json(check, '[{"name": "Ann", "age": 30}, {"name": "Bo"}]')
    assert not check_json(check, "[]") and not check_json(check, "[1, 2]")  # no objects holding the keys
    assert check_json({"kind": "json"}, "[1, 2, 3]")  # no keys: parsing is all


def test_python_parses_the_first_fenced_block_or_the_whole_text():
    answer = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\nIt adds."
    assert check_python({"kind": "python"}, answer)
    assert check_python({"kind": "python", "defines": ["add"]}, answer)
    assert not check_python({"kind": "python", "defines": ["sub"]}, answer)
    assert check_python({"kind": "python"}, "def f():\n    return 1\n")  # no fence: the whole text
    assert not check_python({"kind": "python"}, "```python\ndef add(a, b)\n    return a + b\n```")  # a colon missing
    assert not check_python({"kind": "python"}, "```python\ndef add(a, b):\n    return (a +")  # cut off in its fence
    assert not check_python({"kind": "python"}, "This function adds two numbers.")  # prose is no code
    assert check_python({"kind": "python", "defines": ["Dog", "bark"]}, "```\nclass Dog:\n    def bark(self): ...\n```")


@pytest.mark.parametrize(
    ("check", "message"),
    [
        ("sequence", "must be a JSON object"),
        ({"items": DAYS}, "unknown kind None"),
        ({"kind": "regex", "pattern": "x"}, "unknown kind 'regex'; use one of sequence"),
        ({"kind": "sequence"}, "lacks items"),
        ({"kind": "sequence", "item": DAYS}, "lacks items; has unknown field"),
        ({"kind": "sequence", "items": []}, "non-empty list"),
        ({"kind": "sequence", "items": ["a", 2]}, "non-empty list of non-empty strings"),
        ({"kind": "sequence", "items": ["May", "may"]}, "must not repeat"),
        ({"kind": "sequence", "items": DAYS, "case_sensitive": "yes"}, "true or false"),
        ({"kind": "contains"}, "give 'all'"),
        ({"kind": "contains", "all": "Paris"}, "non-empty list"),
        ({"kind": "number", "value": "42"}, "finite number"),
        ({"kind": "number", "value": True}, "finite number"),
        ({"kind": "number", "value": 42, "tolerance": 1}, "unknown field(s) tolerance"),
        ({"kind": "json", "keys": "name"}, "non-empty list"),
        ({"kind": "python", "defines": [""]}, "non-empty strings"),
    ],
)
def test_a_malformed_check_is_refused_with_what_to_fix(check, message):
    with pytest.raises(ValueError, match="Check|check") as refused:
        check_answer(check, "Monday")
    assert message in str(refused.value)
    with pytest.raises(ValueError):
        validate_check(check)
    kind = check.get("kind") if isinstance(check, dict) else None
    if kind in CHECKS:  # each kind's own function refuses it too
        with pytest.raises(ValueError):
            CHECKS[kind][0](check, "Monday")


def test_the_shipped_checkable_sets_load_and_every_prompt_carries_a_valid_check():
    fields = ("id", "category", "kind", "prompt", "check")
    sets = {name: load_prompts(shipped=name, fields=fields) for name in CHECKABLE}
    ids = {name: [item["id"] for item in records] for name, records in sets.items()}
    for name, records in sets.items():
        assert len(records) >= 12, name
        assert len(set(ids[name])) == len(ids[name]), f"{name}: ids repeat"
        for item in records:
            assert item["kind"] in ("text", "chat") and isinstance(item["prompt"], str) and item["prompt"], item["id"]
            validate_check(item["check"])
        assert {item["check"]["kind"] for item in records} == set(CHECKS), name  # every kind in each set
    assert not set(ids[CHECKABLE[0]]) & set(ids[CHECKABLE[1]])  # dev and held out: disjoint ids ...
    prompts = [{item["prompt"] for item in records} for records in sets.values()]
    assert not prompts[0] & prompts[1]  # ... and prompts
    dev = {item["prompt"]: item for item in sets[CHECKABLE[0]]}
    for prompt in ("List the seven days of the week.", "List the twelve months of the year."):
        assert dev[prompt]["kind"] == "chat" and dev[prompt]["check"]["kind"] == "sequence"
    text = (resources.files("early_exit_router.data") / CHECKABLE[0]).read_text()
    assert all(json.loads(line) for line in text.splitlines() if line.strip())
