"""Whether a generated answer is correct: the `check` a checkable prompt record carries, applied to the decoded text.

Teacher-forced agreement scores each token given the full model's own prefix, so it cannot see a lossy decode that
goes wrong and then stays wrong on its own text (a list that repeats an item, a sum that comes out different). A
check looks at the free-running answer itself. Checks are plain JSON objects with a `kind`:

- `{"kind": "sequence", "items": ["Monday", ...]}`: every item appears exactly once, in this order (a whole word or
  phrase; case-insensitive unless `"case_sensitive": true`);
- `{"kind": "contains", "all": [...], "any": [...]}`: every string of `all` appears, and at least one of `any`
  (either may be left out, not both; same matching as `sequence`);
- `{"kind": "number", "value": 42}`: the number appears in the text as a number of its own (`1,024` and `42.0`
  count; `420` and `4.2` do not);
- `{"kind": "json", "keys": [...]}`: the first JSON object or array (in the first fenced code block if there is one,
  else in the text) parses; an object then holds every key, an array holds objects that each hold them (`keys`
  optional);
- `{"kind": "python", "defines": [...]}`: the first fenced code block (or the whole text, without one) parses as
  Python; `defines` (optional) names functions or classes it must define at any depth.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from typing import Any

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)  # an unclosed fence (a cut-off answer) runs to the end
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w]|\.\d)")


def _strings(check: dict[str, Any], field: str, required: bool = True) -> list[str]:
    """`check[field]` as a non-empty list of non-empty strings (absent and not required: an empty list)."""
    if field not in check and not required:
        return []
    value = check.get(field)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"Check {check!r}: {field!r} must be a non-empty list of non-empty strings.")
    return value


def _case_sensitive(check: dict[str, Any]) -> bool:
    value = check.get("case_sensitive", False)
    if not isinstance(value, bool):
        raise ValueError(f"Check {check!r}: 'case_sensitive' must be true or false.")
    return value


def _pattern(item: str, case_sensitive: bool) -> re.Pattern[str]:
    """`item` as a whole word or phrase: not inside a longer word (edges that are punctuation match as they are)."""
    body = r"\s+".join(re.escape(word) for word in item.split())
    start = r"(?<!\w)" if re.match(r"\w", item.strip()) else ""
    end = r"(?!\w)" if re.search(r"\w$", item.strip()) else ""
    return re.compile(start + body + end, 0 if case_sensitive else re.IGNORECASE)


def check_sequence(check: dict[str, Any], text: str) -> bool:
    """Every item of `check["items"]` appears exactly once in `text`, in this order. Strict on purpose: "1. Monday
    2. Monday 3. Tuesday ..." fails (Monday repeats), and so does a list restated in the text around it ("A to Z:
    A, B, ..."), so a checkable prompt asks for the list alone."""
    validate_check(check)
    case_sensitive = _case_sensitive(check)
    last = -1
    for item in check["items"]:
        found = list(_pattern(item, case_sensitive).finditer(text))
        if len(found) != 1 or found[0].start() <= last:
            return False
        last = found[0].start()
    return True


def check_contains(check: dict[str, Any], text: str) -> bool:
    """Every string of `check["all"]` appears in `text`, and at least one of `check["any"]` where given."""
    validate_check(check)
    case_sensitive = _case_sensitive(check)
    present = [_pattern(item, case_sensitive).search(text) is not None for item in check.get("all", [])]
    alternatives = [_pattern(item, case_sensitive).search(text) is not None for item in check.get("any", [])]
    return all(present) and (not alternatives or any(alternatives))


def numbers_in(text: str) -> list[float]:
    """The numbers written in `text`, in order: integers, decimals and thousands with commas (`1,024`)."""
    return [float(m.group().replace(",", "")) for m in _NUMBER.finditer(text)]


def check_number(check: dict[str, Any], text: str) -> bool:
    """`check["value"]` appears in `text` as a number of its own."""
    validate_check(check)
    return any(math.isclose(n, check["value"], rel_tol=0, abs_tol=1e-9) for n in numbers_in(text))


def first_code_block(text: str) -> str | None:
    """The content of the first fenced code block in `text` (to the end of the text where its fence is not closed),
    or None without one."""
    match = _FENCE.search(text)
    return None if match is None else match.group(1)


def first_json(text: str) -> Any:
    """The first JSON object or array in `text` (in its first fenced code block, if it has one); ValueError where
    there is none or it does not parse."""
    block = first_code_block(text)
    source = text if block is None else block
    start = re.search(r"[\[{]", source)
    if start is None:
        raise ValueError("no JSON object or array in the text")
    value, _ = json.JSONDecoder().raw_decode(source, start.start())
    return value


def check_json(check: dict[str, Any], text: str) -> bool:
    """The first JSON object or array in `text` parses and holds `check["keys"]` (an array: in each element)."""
    validate_check(check)
    try:
        value = first_json(text)
    except ValueError:
        return False
    keys = check.get("keys", [])
    if not keys:
        return True
    objects = value if isinstance(value, list) else [value]
    return bool(objects) and all(isinstance(obj, dict) and all(key in obj for key in keys) for obj in objects)


def check_python(check: dict[str, Any], text: str) -> bool:
    """The first fenced code block in `text` (or the whole text, without one) parses as Python and defines the
    functions or classes `check["defines"]` names, if any."""
    validate_check(check)
    block = first_code_block(text)
    try:
        tree = ast.parse(text if block is None else block)
    except (SyntaxError, ValueError):
        return False
    defined = {
        node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    return all(name in defined for name in check.get("defines", []))


# kind -> (the function, required fields, optional fields)
CHECKS: dict[str, tuple[Callable[[dict[str, Any], str], bool], tuple[str, ...], tuple[str, ...]]] = {
    "sequence": (check_sequence, ("items",), ("case_sensitive",)),
    "contains": (check_contains, (), ("all", "any", "case_sensitive")),
    "number": (check_number, ("value",), ()),
    "json": (check_json, (), ("keys",)),
    "python": (check_python, (), ("defines",)),
}


def validate_check(check: Any) -> None:
    """Refuse, with what to fix, a check that is no object, names an unknown kind, lacks a field or has one it does
    not use (a misspelt field would otherwise be ignored), or holds a field of the wrong type."""
    if not isinstance(check, dict):
        raise ValueError(f"A check must be a JSON object with a 'kind', got {check!r}.")
    kind = check.get("kind")
    if kind not in CHECKS:
        raise ValueError(f"Check {check!r}: unknown kind {kind!r}; use one of {', '.join(CHECKS)}.")
    _, required, optional = CHECKS[kind]
    missing = [f for f in required if f not in check]
    unknown = sorted(set(check) - {"kind", *required, *optional})
    if missing or unknown:
        problems = [f"lacks {', '.join(missing)}"] if missing else []
        problems += [f"has unknown field(s) {', '.join(unknown)}"] if unknown else []
        fields = ", ".join(required + optional) or "none"
        raise ValueError(f"Check {check!r}: {'; '.join(problems)} (a {kind} check's fields: {fields}).")
    if kind == "sequence":
        items = _strings(check, "items")
        keys = items if _case_sensitive(check) else [item.casefold() for item in items]
        if len(set(keys)) != len(keys):
            raise ValueError(f"Check {check!r}: 'items' must not repeat an item.")
    elif kind == "contains":
        if "all" not in check and "any" not in check:
            raise ValueError(f"Check {check!r}: give 'all' (every string must appear), 'any' (one must), or both.")
        _strings(check, "all", required=False)
        _strings(check, "any", required=False)
        _case_sensitive(check)
    elif kind == "number":
        value = check["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"Check {check!r}: 'value' must be a finite number.")
    elif kind == "json":
        _strings(check, "keys", required=False)
    elif kind == "python":
        _strings(check, "defines", required=False)


def check_answer(check: dict[str, Any], text: str) -> bool:
    """Whether `text` (the decoded new text of one generation) passes `check`; ValueError for a malformed check."""
    validate_check(check)
    return CHECKS[check["kind"]][0](check, text)
