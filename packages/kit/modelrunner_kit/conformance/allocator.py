"""The allocator suite: :class:`~modelrunner_kit.allocator_contract.AllocatorContract` as checks.

Every ``test_*`` method of the contract becomes one check, run on an instance whose allocators come
from the plugins (``plugins.create_allocator``), exactly as the engine gets them. What the allocator
says it can do (``supports_prefix_caching``, ``shares_blocks_on_fork``, read from a probe allocator)
decides which rules apply; a rule that does not apply is skipped. The contract needs pytest and
hypothesis; without them every check is skipped.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import re
from collections.abc import Iterator
from typing import Any

from .base import Check, ConformanceError, NotApplicable, Suite, expect


def _contract_class() -> type:
    """The contract class; NotApplicable when its test dependencies are missing."""
    try:
        from ..allocator_contract import AllocatorContract
    except ImportError as e:
        raise NotApplicable(f"the allocator contract needs pytest and hypothesis: {type(e).__name__}: {e}") from None
    return AllocatorContract


def contract_methods() -> list[str]:
    """The contract's ``test_*`` method names, in definition order (empty without pytest/hypothesis)."""
    try:
        cls = _contract_class()
    except NotApplicable:
        return []
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        names += [n for n in vars(klass) if n.startswith("test_") and n not in names]
    return names


def _describe_assertion(e: AssertionError) -> str:
    """A bare ``assert``'s failing source line and the values of the names it uses (pytest's rewriting
    does this inside pytest; the contract may run outside it)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "assertion failed"
    frame, line = tb.tb_frame, tb.tb_lineno
    source = linecache.getline(frame.f_code.co_filename, line).strip()
    used = [f"{n}={v!r}" for n, v in frame.f_locals.items()
            if n != "self" and re.search(rf"\b{re.escape(n)}\b", source)]
    where = f"{frame.f_code.co_name} at {frame.f_code.co_filename.rsplit('/', 1)[-1]}:{line}"
    return f"`{source}` failed ({where})" + (f" with {', '.join(used)}" if used else "")


def _failure_message(e: AssertionError) -> str:
    message = str(e) or _describe_assertion(e)
    notes = getattr(e, "__notes__", None)
    if notes:  # hypothesis' falsifying example
        message += "\n" + "\n".join(notes[-12:])
    return message


@contextlib.contextmanager
def _without_shrinking() -> Iterator[None]:
    """Hypothesis' current settings profile minus the shrink phase, for the ``with`` block."""
    from hypothesis import Phase, settings

    previous = getattr(settings, "get_current_profile_name", lambda: None)()  # hypothesis >= 6.92
    if previous is None:
        yield
        return
    settings.register_profile("modelrunner-conformance-no-shrink", parent=settings.get_profile(previous),
                              phases=[p for p in Phase if p is not Phase.shrink])
    settings.load_profile("modelrunner-conformance-no-shrink")
    try:
        yield
    finally:
        settings.load_profile(previous)


class AllocatorSuite(Suite):
    """Runs the allocator contract on one allocator name, one check per contract test.

    :param max_examples: hypothesis examples of the stateful check (the contract's default: 100).
    :param shrink: let hypothesis shrink a failing stateful example (slower, a shorter example).
    """

    kind = "allocators"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None,
                 max_examples: int | None = None, shrink: bool = True) -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self.max_examples = max_examples
        """Overrides the contract's ``max_examples`` when set."""
        self.shrink = shrink
        """Whether hypothesis shrinks a failing example."""
        self._contract: Any = None

    def _choice(self) -> str:
        """``plugin:name`` of the allocator under test, resolving the plugin once."""
        return f"{self.provider()}:{self.name}"

    def make_allocator(self, num_blocks: int, block_size: int, max_model_len: int,
                       enable_prefix_caching: bool = True) -> Any:
        """A fresh allocator from the plugin, checked to have the asked geometry."""
        from modelrunner import CacheConfig

        choice = self._choice()
        config = CacheConfig(block_size=block_size, kv_allocator=choice, enable_prefix_caching=enable_prefix_caching)
        allocator = self.plugins.create_allocator(choice, num_blocks, block_size, max_model_len, config)
        got = (getattr(allocator, "num_blocks", None), getattr(allocator, "block_size", None),
               getattr(allocator, "max_model_len", None))
        expect(got == (num_blocks, block_size, max_model_len),
               f"allocator made for (num_blocks, block_size, max_model_len) = {(num_blocks, block_size, max_model_len)}"
               f" reports {got}")
        return allocator

    def contract(self) -> Any:
        """The contract instance (made once), its capabilities read from a probe allocator."""
        if self._contract is None:
            suite, base = self, _contract_class()
            probe = self.make_allocator(8, 4, 16, True)

            class Contract(base):  # type: ignore[misc,valid-type]
                supports_prefix_caching = bool(probe.supports_prefix_caching)
                shares_blocks_on_fork = bool(probe.shares_blocks_on_fork)

                def make_allocator(self, num_blocks: int, block_size: int, max_model_len: int,
                                   enable_prefix_caching: bool = True) -> Any:
                    return suite.make_allocator(num_blocks, block_size, max_model_len, enable_prefix_caching)

            if self.max_examples is not None:
                Contract.max_examples = self.max_examples
            self._contract = Contract()
        return self._contract

    def _declared(self) -> None:
        """The registry's ``prefix_caching`` declaration agrees with what the allocator says."""
        contract = self.contract()
        declared = self.plugins.registry.capabilities(self.kind, self.name, self.plugin).get("prefix_caching")
        if declared is None:
            raise NotApplicable(f"allocator {self.name!r} declares no prefix_caching capability")
        expect(bool(declared) == contract.supports_prefix_caching,
               f"allocator {self.name!r} is registered with prefix_caching={declared!r} but its allocators say "
               f"supports_prefix_caching={contract.supports_prefix_caching!r}")

    def _run_method(self, method: str) -> None:
        contract = self.contract()
        import pytest  # importable: the contract needs it

        fn = getattr(contract, method)
        if inspect.signature(fn).parameters:
            raise NotApplicable(f"contract test {method} needs pytest fixtures "
                                f"({', '.join(inspect.signature(fn).parameters)})")
        scope = contextlib.nullcontext() if self.shrink or method != "test_state_machine" else _without_shrinking()
        try:
            with scope:
                fn()
        except pytest.skip.Exception as e:
            raise NotApplicable(str(e.msg) if getattr(e, "msg", None) else str(e)) from None
        except pytest.fail.Exception as e:  # pytest.fail / pytest.raises' "DID NOT RAISE": BaseExceptions
            raise ConformanceError(str(e.msg) if getattr(e, "msg", None) else str(e)) from None
        except AssertionError as e:
            raise ConformanceError(_failure_message(e)) from None
        except Exception as e:
            group = getattr(e, "exceptions", None)  # hypothesis found several distinct failures
            if not group or not all(isinstance(x, AssertionError) for x in group):
                raise
            raise ConformanceError(f"{len(group)} distinct failures:\n" + "\n".join(
                f"{i + 1}. {_failure_message(x)}" for i, x in enumerate(group))) from None

    def checks(self) -> list[Check]:
        """``declared-capabilities``, then one check per contract test (named without ``test_``)."""
        out = [Check("declared-capabilities", self._declared)]
        methods = contract_methods()
        if not methods:
            out.append(Check("contract", lambda: _contract_class()))
        for method in methods:
            out.append(Check(method.removeprefix("test_").replace("_", "-"), lambda m=method: self._run_method(m)))
        return out


__all__ = ["AllocatorSuite", "contract_methods"]
