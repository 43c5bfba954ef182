"""Argument checks written once: every error names the parameter and what is allowed.

Bad input must end in a one-line message a user can act on, never in a traceback from inside torch.
"""
from __future__ import annotations

from typing import Any, ClassVar, Sequence


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None, what: str = "") -> int:
    """An int in [low, high] (either bound optional); `what` says what the number means."""
    ok = is_int(value) and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        rng = (f" >= {low}" if high is None else f" in [{low}, {high}]") if low is not None else \
            (f" <= {high}" if high is not None else "")
        raise ValueError(f"{name}{f' ({what})' if what else ''} must be an int{rng}, got {value!r}")
    return value


def check_real(name: str, value: Any, low: float | None = None, high: float | None = None, *,
               low_open: bool = False, what: str = "") -> float:
    """A real number in [low, high] ((low, high] with low_open)."""
    ok = is_real(value) and value == value
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}, "
        if high is not None:
            rng = f" in {lo}{high}]"
        else:
            rng = f" {'>' if low_open else '>='} {low}" if low is not None else ""
        raise ValueError(f"{name}{f' ({what})' if what else ''} must be a number{rng}, got {value!r}")
    return float(value)


def check_prob(name: str, value: Any, what: str = "") -> float:
    """A confidence threshold in (0, 1]."""
    return check_real(name, value, 0.0, 1.0, low_open=True, what=what)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_split(split: Any, n_layers: int) -> int:
    """The exit layer k of a self-speculative drafter: 0 < k < L."""
    if not is_int(split) or not 0 < split < n_layers:
        raise ValueError(f"split (exit layer k) must be an int with 0 < k < {n_layers} (the model's layers), "
                         f"got {split!r}")
    return split


def default_split(n_layers: int) -> int:
    """The default exit layer of every self-speculative method: the first sixth of the layers (>= 1).

    One rule for early_exit, kangaroo and dvi: the course model's 12 layers give 2 (Kangaroo's layer 2
    of 32 is shallower still; a smaller model has less redundancy, so it exits relatively later).
    """
    return max(1, n_layers // 6)


# Names the course's notation took back: old name -> (new name, what it is). k is the exit layer now, τ the tokens
# per target forward, so the draft length is K and DVI's time constant T_λ.
RENAMED = {"k": ("K", "draft tokens per step; k means the exit layer"),
           "tau": ("t_lambda", "DVI's time constant T_λ; τ means tokens per target forward")}


class RenamedError(TypeError, ValueError):
    """An old name of the notation: a wrong keyword (TypeError) and a wrong option (ValueError) at once."""


def renamed(name: str, flag: bool = False) -> str:
    """'k is now K (draft tokens per step; k means the exit layer)'; flag: as command-line flags ('--k is now --K')."""
    new, what = RENAMED[name]
    old, new = (f"--{name}", "--" + new.replace("_", "-")) if flag else (name, new)
    return f"{old} is now {new} ({what})"


def reject_renamed(kwargs: dict, where: str) -> None:
    """Fail on keywords that a function no longer takes: an old name (RENAMED) names its new one; any other
    keyword fails as Python would. For `**old` catch-alls and option dicts."""
    for name in kwargs:
        if name in RENAMED:
            raise RenamedError(f"{where}: {renamed(name)}")
    if kwargs:
        raise TypeError(f"{where}() got an unexpected keyword argument {next(iter(kwargs))!r}")


class RenamedFields:
    """A dataclass's base: a constructor keyword among `renamed_fields` fails naming its new name."""
    renamed_fields: ClassVar[tuple[str, ...]] = ()

    def __new__(cls, *args, **kwargs):
        reject_renamed({n: kwargs[n] for n in cls.renamed_fields if n in kwargs}, cls.__name__)
        return super().__new__(cls)


def new_names(saved: dict) -> dict:
    """A dict saved before the renames (a DVI config, a recipe, settings) under the new names: k -> K, tau ->
    t_lambda. Only for dicts whose k is the draft length and whose tau is DVI's time constant."""
    return {RENAMED[n][0] if n in RENAMED else n: v for n, v in saved.items()}


def add_renamed_flags(ap, *names: str) -> None:
    """Hidden old flags (`--k`, `--tau`) on an argparse parser that stop with the new flag's name."""
    import argparse

    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(renamed(self.dest, flag=True))

    for name in names:
        ap.add_argument(f"--{name}", dest=name, nargs="?", action=Renamed, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
