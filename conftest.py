"""Docs as tests: every fenced block of README.md and docs/**/*.md runs under pytest, with Sybil.

Sybil (a maintained pytest plugin for documentation examples) finds the blocks, runs a page's
blocks in order in one namespace, and turns ``<!-- skip: next "reason" -->`` into a skip that
pytest reports with its reason. This file says what each kind of block means:

* ```` ```python ````: executed; the blocks of a page share one module namespace, as for a reader
  who runs them in order.
* ```` ```bash ```` (``sh``, ``shell``): executed by bash, each command checked for exit status 0.
  A command ending in ``&`` starts a background service that lives until the page's last block
  has run: the block waits until the ports the command names (``--port``, ``--http-port``)
  accept connections, and at the end of the page the service gets SIGTERM and must exit 0
  (a program other than ``kvdrop`` may also die of the signal).
* ```` ```toml ````, ```` ```json ````: parsed.
* ```` ```text ````: shown, not run (signatures, measured tables).
* A block without a language, or in another language, fails: say what it is.

**Skips.** ``<!-- skip: next "why" -->`` before a block skips it, and pytest shows why;
``<!-- skip: next requires("lmcache") -->`` skips it only when that module cannot be imported
(unless ``KVDROP_REQUIRE_LMCACHE=1``, as in CI: then the block runs).

**Each block runs alone.** The page's namespace is shared for speed, but a reader may copy any
one block: ``tests/test_docs_alone.py`` checks that every python block binds every name it
reads (or says ``<!-- continues: "why" -->`` before it) and that every skip gives its reason.

**Shown output is compared.** Lines ``#> ...`` in a block are what it prints. A python block's
whole stdout must match its ``#>`` lines; in a bash block, the ``#>`` lines under a command must
match that command's output (stdout and stderr, as a terminal shows them). ``...`` matches any
text (doctest's ELLIPSIS, across lines too); trailing spaces do not count.

**Isolation.** Per page, every port a block names (``localhost:N``, ``127.0.0.1:N``,
``--port N``, ``--http-port N``) is replaced by a free port and every ``--shm-name NAME`` by a
unique name, the same way in code and shown output, so pages never collide with each other or
with anything else on the machine; commands run in a temporary folder that links the
repository's top-level files.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import SkipParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

# Engines, servers and clients share two cores: spinning OpenMP workers steal them from each
# other. Set before torch loads; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent
PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell")
SHOWN = ("text",)
#: Longest a foreground bash block may run, and a background service may take to listen.
COMMAND_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 180.0
#: Longest a background service may take to exit after SIGTERM at the end of its page.
STOP_TIMEOUT_S = 60.0

_PORT = re.compile(
    r"(?P<pre>(?:localhost|127\.0\.0\.1|\[::1\]):|--port[ =]|--http-port[ =])(?P<port>\d{2,5})\b"
)
_SHM = re.compile(r"--shm-name[ =](?P<name>[A-Za-z0-9_.-]+)")
_EXPECTED = re.compile(r"^[ \t]*#>(?: (?P<text>.*)|$)")
_BACKGROUND = re.compile(r"(?<![&|])&[ \t]*(?:#.*)?$")
_MARK = "@@kvdrop-docs-step-{}@@"


def is_doc_page(path: Path) -> bool:
    """README.md at the top and every Markdown file under docs/."""
    path = path.resolve()
    if path.suffix != ".md":
        return False
    return path == ROOT / "README.md" or (ROOT / "docs") in path.parents


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One fenced block: its language (first word of the info string) and its text."""

    language: str
    source: str


def expected_output(source: str) -> str | None:
    """The ``#>`` lines of ``source`` as text, or None when it shows no output."""
    lines = [m.group("text") or "" for m in map(_EXPECTED.match, source.splitlines()) if m]
    return "\n".join(lines) if lines else None


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()) + "\n"


def output_matches(want: str, got: str) -> bool:
    """doctest's comparison with ELLIPSIS, ignoring trailing spaces and blank edges."""
    return doctest.OutputChecker().check_output(
        _normalized(want), _normalized(got), doctest.ELLIPSIS
    )


def _mismatch(what: str, want: str, got: str) -> AssertionError:
    return AssertionError(
        f"{what} printed something else than the page shows.\n"
        f"--- shown (#> lines; ... matches anything) ---\n{_normalized(want)}"
        f"--- printed ---\n{_normalized(got)}"
    )


# ---------------------------------------------------------------------------------------------
# Per-page state: resources, working folder, background services
# ---------------------------------------------------------------------------------------------


def _program(command: str) -> str:
    """The program a shell command runs (after ``NAME=value`` assignments)."""
    words = command.split()
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
        words.pop(0)
    return words[0] if words else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    """A background command of a page (a line ending in ``&``)."""

    command: str
    line: int
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Page:
    """What the blocks of one page share besides their Python namespace."""

    path: Path
    workdir: Path
    ports: dict[str, str] = field(default_factory=dict)
    shm_names: dict[str, str] = field(default_factory=dict)
    services: list[Service] = field(default_factory=list)

    @classmethod
    def open(cls, path: Path) -> Page:
        workdir = Path(tempfile.mkdtemp(prefix=f"kvdrop-docs-{path.stem}-"))
        for entry in ROOT.iterdir():
            if not entry.name.startswith(".") and entry.name != "conftest.py":
                (workdir / entry.name).symlink_to(entry)
        page = cls(path, workdir)
        for name in _SHM.findall(path.read_text(encoding="utf-8")):
            page.shm_names.setdefault(name, f"{name}_{os.getpid()}_{uuid.uuid4().hex[:6]}")
        return page

    def rewrite(self, source: str) -> str:
        """``source`` with this page's free ports and unique shared-memory names."""

        def port(m: re.Match[str]) -> str:
            documented = m.group("port")
            if documented == "0":
                return m.group(0)
            if documented not in self.ports:
                self.ports[documented] = str(_free_port())
            return m.group("pre") + self.ports[documented]

        source = _PORT.sub(port, source)
        for name, unique in self.shm_names.items():
            source = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", unique, source)
        return source

    def env(self) -> dict[str, str]:
        bindir = str(Path(sys.executable).parent)
        return {
            **os.environ,
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONUNBUFFERED": "1",
        }

    def start(self, command: str, line: int, want: str | None) -> None:
        """Start a background command, wait until it listens (and shows ``want``)."""
        log = self.workdir / f"service-{len(self.services)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", command],
                cwd=self.workdir,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        service = Service(command, line, proc, log)
        self.services.append(service)
        ports = [int(m.group("port")) for m in _PORT.finditer(command) if m.group("pre")[0] == "-"]
        if not ports and re.search(r"\bkvdrop\s+(engine|server)\b", command):
            raise AssertionError(
                f"line {line}: `{command}` runs in the background without --port (and "
                "--http-port for a server): name its ports so the docs test can give it free ones"
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = set(ports)
        while waiting or want is not None:
            if proc.poll() is not None:
                raise AssertionError(
                    f"line {line}: `{command}` exited with {proc.returncode} before it was "
                    f"ready:\n{service.output()}"
                )
            for p in list(waiting):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", p), 1):
                    waiting.discard(p)
            if not waiting and (want is None or output_matches(want, service.output())):
                return
            if time.monotonic() > deadline:
                if want is not None and not waiting:
                    raise _mismatch(f"line {line}: `{command}`", want, service.output())
                raise AssertionError(
                    f"line {line}: `{command}` did not listen on {sorted(waiting)} within "
                    f"{READY_TIMEOUT_S:.0f} s:\n{service.output()}"
                )
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the services (SIGTERM, newest first); each must exit 0. Remove the folder."""
        problems = []
        for service in reversed(self.services):
            proc = service.proc
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    problems.append(f"line {service.line}: `{service.command}` ignored SIGTERM")
            # kvdrop's own commands promise exit 0 on SIGTERM; others may die of it (LMCache)
            stopped = proc.returncode == -signal.SIGTERM and _program(service.command) != "kvdrop"
            if proc.returncode != 0 and not stopped:
                problems.append(
                    f"line {service.line}: `{service.command}` exited with {proc.returncode}:\n"
                    + service.output()[-3000:]
                )
        self.services.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if problems:
            raise AssertionError(f"{self.path.name}: " + "\n".join(problems))


# ---------------------------------------------------------------------------------------------
# Evaluators
# ---------------------------------------------------------------------------------------------


def _page(example: Example) -> Page:
    page = example.namespace["__kvdrop_docs_page__"]
    assert isinstance(page, Page)
    return page


def run_python(example: Example) -> None:
    """Execute the block in the page's namespace; compare stdout with its ``#>`` lines."""
    __tracebackhide__ = True
    page = _page(example)
    block: Block = example.parsed
    source = page.rewrite(block.source)
    code = compile("\n" * example.line + source, example.path, "exec", dont_inherit=True)
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(page.workdir)
    try:
        with contextlib.redirect_stdout(out):
            exec(code, example.namespace)
    finally:
        os.chdir(cwd)
        sys.stdout.write(out.getvalue())  # still visible with -s or on failure
    want = expected_output(source)
    if want is not None and not output_matches(want, out.getvalue()):
        raise _mismatch(f"the python block at line {example.line}", want, out.getvalue())


@dataclass
class Command:
    """One logical command of a bash block (continuation lines joined)."""

    text: str
    line: int
    want_lines: list[str] = field(default_factory=list)

    @property
    def background(self) -> bool:
        return _BACKGROUND.search(self.text) is not None

    @property
    def want(self) -> str | None:
        return "\n".join(self.want_lines) if self.want_lines else None


def bash_commands(source: str, first_line: int) -> list[Command]:
    """Split a bash block into commands; ``#>`` lines belong to the command above them."""
    commands: list[Command] = []
    pending: list[str] = []
    for offset, line in enumerate(source.splitlines()):
        expected = _EXPECTED.match(line)
        if expected:
            if not commands or pending:
                raise AssertionError(
                    f"line {first_line + offset}: a #> line must follow a command it shows"
                )
            commands[-1].want_lines.append(expected.group("text") or "")
            continue
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending.append(line)
        if not line.rstrip().endswith("\\"):
            start = first_line + offset - len(pending) + 1
            commands.append(Command("\n".join(pending), start))
            pending = []
    if pending:
        raise AssertionError(f"line {first_line}: the block ends inside a continued command")
    return commands


def _run_foreground(page: Page, commands: list[Command], line: int) -> None:
    """Run consecutive foreground commands in one bash; check each one's shown output."""
    script = ["set -eo pipefail", "exec 2>&1"]
    for i, cmd in enumerate(commands):
        script += [f"printf '\\n{_MARK.format(i)}\\n'", cmd.text]
    try:
        done = subprocess.run(
            ["bash", "-c", "\n".join(script)],
            cwd=page.workdir,
            env=page.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            timeout=COMMAND_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"line {line}: the commands did not finish within {COMMAND_TIMEOUT_S:.0f} s; a "
            "command that serves until stopped needs a trailing `&`, a long run a "
            '`<!-- skip: next "why" -->` before its block'
        ) from exc
    text = done.stdout.decode(errors="replace")
    parts = re.split(r"\n?" + _MARK.format(r"(\d+)") + r"\n", text)
    outputs: dict[int, str] = {int(i): out for i, out in zip(parts[1::2], parts[2::2])}
    if done.returncode != 0:
        failed = commands[max(outputs, default=0)]
        raise AssertionError(
            f"line {failed.line}: `{failed.text}` failed (exit status {done.returncode}):\n"
            + outputs.get(commands.index(failed), text)[-3000:]
        )
    for i, cmd in enumerate(commands):
        want = cmd.want
        if want is not None and not output_matches(want, outputs.get(i, "")):
            raise _mismatch(f"line {cmd.line}: `{cmd.text}`", want, outputs.get(i, ""))


def run_bash(example: Example) -> None:
    """Run the block's commands in order: foreground ones in bash, ``&`` ones as services."""
    __tracebackhide__ = True
    page = _page(example)
    block: Block = example.parsed
    commands = bash_commands(page.rewrite(block.source), example.line + 1)
    foreground: list[Command] = []
    for cmd in commands:
        if not cmd.background:
            foreground.append(cmd)
            continue
        if foreground:
            _run_foreground(page, foreground, foreground[0].line)
            foreground = []
        text = _BACKGROUND.sub("", cmd.text).rstrip()
        page.start(text, cmd.line, cmd.want)
    if foreground:
        _run_foreground(page, foreground, foreground[0].line)


def parse_toml(example: Example) -> None:
    """The block is valid TOML."""
    import tomllib

    tomllib.loads(example.parsed.source)


def parse_json(example: Example) -> None:
    """The block is valid JSON."""
    json.loads(example.parsed.source)


def unlabelled(example: Example) -> None:
    """A block whose language says nothing the docs test can use."""
    language = example.parsed.language
    what = f"in language {language!r}" if language else "without a language"
    raise AssertionError(
        f"{Path(example.path).name}, line {example.line}: a fenced block {what}. Say what it "
        "is: ```python or ```bash to run it (lines `#> ...` show its output), ```text for "
        'text that is only shown, or put <!-- skip: next "why" --> before a block that cannot '
        "run here."
    )


def misplaced_skip(example: Example) -> None:
    """A skip directive in front of a block that is never run."""
    raise AssertionError(
        f"{Path(example.path).name}, line {example.line}: a skip directive before a "
        "```text block (text is never run, so the skip would land on the next block); remove it"
    )


# ---------------------------------------------------------------------------------------------
# Sybil wiring
# ---------------------------------------------------------------------------------------------


class FenceParser:
    """Every fenced block becomes one example whose evaluator follows its language."""

    lexer = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<info>[^\n]*)$\n", re.MULTILINE))
    evaluators: ClassVar[dict[str, Callable[[Example], None]]] = {
        **dict.fromkeys(PYTHON, run_python),
        **dict.fromkeys(SHELL, run_bash),
        "toml": parse_toml,
        "json": parse_json,
    }

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self.lexer(document):
            info = str(region.lexemes["info"]).strip()
            language = info.split()[0].lower() if info else ""
            block = Block(language, str(region.lexemes["source"]))
            if language in SHOWN:
                skip = re.search(r"<!--\s*skip:[^>]*-->\s*$", document.text[: region.start])
                if skip:  # reported just before the directive, which would skip the report
                    yield Region(skip.start(), skip.start(), block, misplaced_skip)
                continue
            evaluator = self.evaluators.get(language, unlabelled)
            yield Region(region.start, region.end, block, evaluator)


class PageDocument(Document):
    """A page whose namespace is a registered module's (dataclasses and typing look it up)."""

    def __init__(self, text: str, path: str) -> None:
        super().__init__(text, path)
        slug = re.sub(r"\W", "_", str(Path(path).resolve().relative_to(ROOT).with_suffix("")))
        self.module = types.ModuleType(f"kvdrop_docs_{slug}")
        self.namespace = self.module.__dict__
        self.namespace["__kvdrop_docs_module__"] = self.module
        self.namespace["__kvdrop_docs_path__"] = Path(path)


def requires(module: str) -> str | None:
    """A skip reason when ``module`` cannot be imported, for ``skip: next requires("name")``;
    none when ``KVDROP_REQUIRE_<NAME>=1`` asks for the block to run regardless."""
    if os.environ.get(f"KVDROP_REQUIRE_{module.upper()}") == "1":
        return None
    if importlib.util.find_spec(module) is not None:
        return None
    return f"{module} is not installed"


def _setup(namespace: dict[str, Any]) -> None:
    module = namespace["__kvdrop_docs_module__"]
    sys.modules[module.__name__] = module
    namespace["requires"] = requires
    namespace["__kvdrop_docs_page__"] = Page.open(namespace["__kvdrop_docs_path__"])


def _teardown(namespace: dict[str, Any]) -> None:
    sys.modules.pop(namespace["__kvdrop_docs_module__"].__name__, None)
    namespace.pop("__kvdrop_docs_page__").close()


_collect_page = Sybil(
    parsers=[SkipParser(), FenceParser()],
    patterns=["*.md"],
    setup=_setup,
    teardown=_teardown,
    document_types={".md": PageDocument},
).pytest()


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """Collect README.md and docs/**/*.md with Sybil (``testpaths`` names them)."""
    return _collect_page(file_path, parent) if is_doc_page(file_path) else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A docs block that hangs fails instead of stalling the run (pytest-timeout)."""
    for item in items:
        if is_doc_page(Path(str(item.path))):
            item.add_marker(pytest.mark.timeout(COMMAND_TIMEOUT_S + READY_TIMEOUT_S))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A skipped block is reported at its own line of its page, with its reason."""
    outcome = yield
    report = outcome.get_result()
    example = getattr(item, "example", None)
    if report.skipped and isinstance(example, Example) and isinstance(report.longrepr, tuple):
        report.longrepr = (str(item.path), example.line, report.longrepr[2])
