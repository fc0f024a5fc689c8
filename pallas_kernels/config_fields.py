"""The field rules of the kernels' frozen block configs, checked one way for every family: a config's
``__post_init__`` calls :func:`check_fields` with a rule per field, and one ValueError names every field that
breaks its rule (``invalid GatherConfig: block_k must be a power of 2; got 12``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a field must be, in words (``requirement``), and the test of a value (``holds``)."""

    requirement: str
    holds: Callable[[object], bool]

    def or_none(self) -> Rule:
        """The same rule, with None allowed too (the kernel picks that field)."""
        return Rule(f"{self.requirement} or None", lambda value: value is None or self.holds(value))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


POSITIVE = Rule("a positive int", lambda value: _is_int(value) and value >= 1)
POWER_OF_2 = Rule("a power of 2", lambda value: _is_int(value) and is_power_of_2(value))


def power_of_2_at_least(minimum: int) -> Rule:
    return Rule(f"a power of 2 >= {minimum}", lambda value: POWER_OF_2.holds(value) and value >= minimum)


def multiple_of(step: int, why: str) -> Rule:
    """A positive multiple of ``step``; ``why`` says where the step comes from (the lane width, a register tile)."""
    return Rule(f"a positive multiple of {step} ({why})", lambda value: _is_int(value) and value >= step
                and value % step == 0)


def one_of(choices: tuple[str, ...], what: str) -> Rule:
    return Rule(f"{what}, one of {list(choices)}", lambda value: value in choices)


def check_fields(config: object, **rules: Rule) -> None:
    """ValueError naming ``config``'s class and every field (keyword) whose value breaks its rule."""
    problems = [f"{name} must be {rule.requirement}; got {getattr(config, name)!r}"
                for name, rule in rules.items() if not rule.holds(getattr(config, name))]
    if problems:
        raise ValueError(f"invalid {type(config).__name__}: " + "; ".join(problems))
