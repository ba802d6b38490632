"""The docs-as-tests collection (conftest.py) catches what it promises: pages made here, run by a
real pytest in a folder of their own with a copy of conftest.py, fail when a block's output
drifts, a command fails or a block does not say what it is, and report skips with their reason."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

#: A service for the pages: answers every GET with the address it listens on; SIGTERM -> exit 0
#: (or the code given by --exit-code).
SERVE = """
import argparse, http.server, signal, sys

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--exit-code", type=int, default=0)
args = parser.parse_args()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(args.exit_code))


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"listening on 127.0.0.1:{args.port}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


server = http.server.HTTPServer(("127.0.0.1", args.port), Handler)
print(f"listening on 127.0.0.1:{args.port}", flush=True)
server.serve_forever()
"""

PAGE = """
# A page

```python
print("hello")
#> hello
```

```python
print("world")
#> word
```

```python
import math

print(f"pi is {math.pi}")
#> pi is 3.14...
```

```bash
echo one
#> one
echo two
#> 2
```

```bash
echo fine
false
echo never
```

<!-- skip: next "needs a GPU" -->
```bash
exit 1
```

```text
shown, never run
```

```
unlabelled
```

```yaml
a: 1
```

```toml
[broken
```

```json
{"valid": true}
```

<!-- skip: next requires("no_such_module_for_kvdrop_docs") -->
```python
raise SystemExit("never runs")
```

<!-- skip: next requires("json") -->
```python
print("runs")
#> runs
```

<!-- skip: next "a skip in front of text" -->
```text
x
```
"""

SERVICE_PAGE = """
# Services

```bash
python serve.py --port 8000 &
#> listening on 127.0.0.1:8000
```

```python
from urllib.request import urlopen

body = urlopen("http://127.0.0.1:8000/").read().decode()
assert body != "listening on 127.0.0.1:" + "8000", "the documented port was used as is"
print(body)
#> listening on 127.0.0.1:8000
```

```bash
curl -s localhost:8000/
#> listening on 127.0.0.1:8000
```
"""

BAD_SERVICE_PAGE = """
```bash
python serve.py --port 8000 --exit-code 3 &
```
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Run pytest on the pages; map each item (page, line) to (outcome, message)."""
    root = tmp_path_factory.mktemp("pages")
    (root / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = README.md docs\n")
    (root / "serve.py").write_text(SERVE)
    (root / "README.md").write_text(textwrap.dedent(PAGE))
    (root / "docs").mkdir()
    (root / "docs" / "services.md").write_text(textwrap.dedent(SERVICE_PAGE))
    (root / "docs" / "bad-service.md").write_text(textwrap.dedent(BAD_SERVICE_PAGE))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml=out.xml", "-q"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (root / "out.xml").exists(), done.stdout + done.stderr
    results = {}
    for case in ET.parse(root / "out.xml").getroot().iter("testcase"):
        page = case.get("classname", "").replace(".", "/")
        key = f"{page}:{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag if outcome == "passed" else f"{outcome}+{child.tag}"
                message += (child.get("message") or "") + "\n" + (child.text or "")
        results[key] = (outcome, message)
    return results


def outcome(outcomes: dict[str, tuple[str, str]], page: str, line: int) -> tuple[str, str]:
    for key, value in outcomes.items():
        if key.startswith(page) and key.endswith(f"line:{line},column:1"):
            return value
    raise AssertionError(f"no item for {page} line {line}: {sorted(outcomes)}")


def test_python_output_is_compared(outcomes: dict[str, tuple[str, str]]) -> None:
    assert outcome(outcomes, "README", 4) == ("passed", "")
    result, message = outcome(outcomes, "README", 9)
    assert result == "failure" and "printed something else than the page shows" in message
    assert "word" in message and "world" in message
    assert outcome(outcomes, "README", 14)[0] == "passed"  # ... matches the digits


def test_bash_commands_are_checked_one_by_one(outcomes: dict[str, tuple[str, str]]) -> None:
    result, message = outcome(outcomes, "README", 21)
    assert result == "failure" and "`echo two`" in message and "`echo one`" not in message
    result, message = outcome(outcomes, "README", 28)
    assert result == "failure" and "`false` failed (exit status 1)" in message


def test_skips_carry_their_reason(outcomes: dict[str, tuple[str, str]]) -> None:
    result, message = outcome(outcomes, "README", 35)
    assert result == "skipped" and "needs a GPU" in message
    result, message = outcome(outcomes, "README", 60)
    assert result == "skipped" and "no_such_module_for_kvdrop_docs is not installed" in message
    assert outcome(outcomes, "README", 65) == ("passed", "")  # json is there: it runs


def test_every_block_says_what_it_is(outcomes: dict[str, tuple[str, str]]) -> None:
    assert not any(key.startswith("README") and "line:39," in key for key in outcomes)  # text
    for line, language in ((43, "without a language"), (47, "in language 'yaml'")):
        result, message = outcome(outcomes, "README", line)
        assert result == "failure" and language in message and "Say what it is" in message
    assert outcome(outcomes, "README", 51)[0] == "failure"  # invalid TOML
    assert outcome(outcomes, "README", 55)[0] == "passed"  # valid JSON
    result, message = outcome(outcomes, "README", 70)
    assert result == "failure" and "skip directive before a" in message


def test_background_services_on_free_ports(outcomes: dict[str, tuple[str, str]]) -> None:
    for line in (4, 9, 18):
        assert outcome(outcomes, "docs/services", line) == ("passed", "")


def test_a_service_must_stop_cleanly(outcomes: dict[str, tuple[str, str]]) -> None:
    result, message = outcome(outcomes, "docs/bad-service", 2)
    assert result == "error" and "exited with 3" in message  # at the end of the page
