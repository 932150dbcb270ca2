"""RegistryTarget: a Target whose engine keeps its architectures in a registry that its general plugins extend, and
the one ``describe`` such targets share.

Describing one loads its general plugins one at a time under the CUDA guard, as the engine loads them (a plugin that
raises is a ``PluginError``, worded as the plugins check words it), then lists the registry, then leaves out what a
failed plugin registered. What differs between engines is the subclass's: ``architectures`` (the registry once the
plugins loaded), ``unavailable`` (what the engine raises when it cannot be described here) and ``quiet`` (the
engine's output kept off the terminal, and shown only when describing fails).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from abc import abstractmethod
from collections.abc import Iterator

from pytest_enginecheck.checks.plugins_check import plugin_errors
from pytest_enginecheck.targets import Target, TargetDescription, TargetError, without_failed

OUTPUT_TAIL = 4000  # characters of the engine's output a failed description shows


@contextlib.contextmanager
def output_into(fd: int) -> Iterator[None]:
    """File descriptors 1 and 2 into ``fd`` while the block runs (an engine's log handlers may write to fd 1)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, target)
            os.close(copy)


class RegistryTarget(Target):
    """A Target described the shared way (see the module docstring): subclass it and implement ``architectures``."""

    quiet = False  # capture the engine's output while describing; a failure then shows it, naming the target

    @abstractmethod
    def architectures(self, strict: bool = False) -> TargetDescription:
        """The registry's architectures once the general plugins loaded (``describe`` loaded them), with the kind and
        the offer; ``describe`` adds the plugins and leaves out what a failed one registered."""

    def unavailable(self) -> tuple[type[Exception], ...]:
        """What the engine raises when it cannot be described here: a usage error ``--enginecheck-target=<spec>:
        <its message>``."""
        return ()

    def describe(self, strict: bool = False) -> TargetDescription:
        loader = self.plugin_loader()
        with tempfile.TemporaryFile() as log:
            try:
                with output_into(log.fileno()) if self.quiet else contextlib.nullcontext():
                    outcomes = loader.load_plugins(strict) if loader else ()
                    errors = plugin_errors(self, outcomes)
                    found = self.architectures(strict)
                    plugins = loader.list_plugins() if loader else ()
            except self.unavailable() as e:
                raise TargetError(f"--enginecheck-target={self.spec}: {e}") from None
            except Exception as e:
                if not self.quiet:  # the session names the target and the exception
                    raise
                log.seek(0)
                printed = log.read().decode(errors="replace").strip()[-OUTPUT_TAIL:]
                raise TargetError(f"--enginecheck-target={self.spec} could not be loaded: {type(e).__name__}: {e}"
                                  + (f"\nIts output:\n{printed}" if printed else "")) from None
        entries, listed = without_failed(found.entries, plugins, errors)
        registered = tuple(dict.fromkeys(arch for outcome in outcomes for arch in outcome.registered))
        return dataclasses.replace(found, entries=entries, plugins=listed, plugin_errors=errors,
                                   from_plugins=registered)
