"""One process launcher (issue 22): long-lived child processes are started through
ddiloco/cli/processes.py `ProcessControl` (LocalCluster / ServiceProcess, EtcdMember), nowhere else.

Read as ASTs, the Python files of ddiloco/, services/, scripts/ and tests/ may start a process that
outlives the call (Popen, asyncio's create_subprocess_*, os.spawn*/posix_spawn/fork,
multiprocessing.Process) only in the launcher itself and in the few tests whose subject is that
process (ALLOWED, each with its reason). A service (`-m services.<name>`) is never started so
outside the launcher, not even there; run as a one-shot command (subprocess.run and friends) it
must be bounded by `timeout=`. One-shot commands of other programs (git, `ddiloco report`) are
not this contract's business.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TREES = ("ddiloco", "services", "scripts", "tests")
LAUNCHER = "ddiloco/cli/processes.py"
# Files that start a process of their own, and why that process is not the launcher's to start.
ALLOWED = {
    "tests/integration/test_cli.py": "the subject is the `ddiloco up` / `status --watch` CLI process itself",
    "tests/integration/test_record.py": "the subject is the `ddiloco record` CLI process, interrupted mid-run",
    "tests/security/test_cli_credentials.py": "the subject is the `ddiloco dashboard` CLI process and its credentials",
    "tests/integration/test_embedded_learner.py": "the subject is the embedded-learner example script",
    "tests/unit/test_compilation_cache.py": "the subject is a fresh interpreter's JAX compilation cache",
    "tests/browser.py": "headless Chromium, one bounded run in its own process group",
    "tests/docker/conftest.py": "docker / compose commands, bounded, killed by their own process group",
}
SPAWNERS = frozenset({"Popen", "create_subprocess_exec", "create_subprocess_shell", "fork", "forkpty",
                      "posix_spawn", "posix_spawnp", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv",
                      "spawnve", "spawnvp", "spawnvpe", "Process"})
ONE_SHOT = frozenset({"run", "call", "check_call", "check_output"})  # subprocess's
# Every file that can call one of the above names one of these (an import or the call itself).
_MENTIONS = ("subprocess", "Popen", "spawn", "fork", "Process")


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _launches_a_service(call: ast.Call) -> bool:
    """Whether the call's arguments spell `-m services.<...>` (in a list, a tuple or directly)."""
    strings = [n.value for arg in call.args for n in ast.walk(arg)
               if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return any(a == "-m" and b.startswith("services.") for a, b in zip(strings, strings[1:]))


def file_violations(relative: str, source: str | ast.Module) -> list[str]:
    """What `source` (the file at `relative`, or its parsed tree) does against the contract, one line each."""
    out = []
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        if not isinstance(node, ast.Call):
            continue
        name, where = _called_name(node), f"{relative}:{node.lineno}"
        if name in SPAWNERS and relative != LAUNCHER:
            if _launches_a_service(node):
                out.append(f"{where}: starts a service with {name}; use LocalCluster / ServiceProcess")
            elif relative not in ALLOWED:
                out.append(f"{where}: starts a process with {name} outside {LAUNCHER} (ProcessControl)")
        elif name in ONE_SHOT and _launches_a_service(node) and not any(k.arg == "timeout" for k in node.keywords):
            out.append(f"{where}: runs a service with {name} without timeout=")
    return out


def violations(root: pathlib.Path) -> tuple[list[str], set[str]]:
    """(every violation under `root`'s TREES, the files that start a process of their own)."""
    found, spawning = [], set()
    for tree in TREES:
        for path in sorted((root / tree).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            source = path.read_text(encoding="utf-8")
            if relative.startswith("ddiloco/v1/") or not any(word in source for word in _MENTIONS):
                continue  # generated, or nothing that could start a process (parsing all takes seconds)
            parsed = ast.parse(source)
            found += file_violations(relative, parsed)
            if any(isinstance(n, ast.Call) and _called_name(n) in SPAWNERS for n in ast.walk(parsed)):
                spawning.add(relative)
    return found, spawning


def test_long_lived_processes_are_started_only_through_the_launcher():
    found, spawning = violations(ROOT)
    assert found == []
    assert LAUNCHER in spawning  # the scan sees the launcher's own Popen
    stale = sorted(set(ALLOWED) - spawning)
    assert not stale, f"allowed but no longer starting a process (drop them from ALLOWED): {stale}"


def test_the_contract_catches_a_test_that_supervises_a_service_itself():
    # The negative cases: test_checkpoint_process.py as it was before it used the cluster fixture,
    # a service started even by an allow-listed file, a new file starting a helper process, an
    # unbounded one-shot service run; and the shapes the contract allows.
    own = 'proc = subprocess.Popen([sys.executable, "-m", "services.checkpoint", "--bind", "127.0.0.1:0"])\n'
    assert len(file_violations("tests/integration/test_checkpoint_process.py", own)) == 1
    assert "starts a service" in file_violations("tests/integration/test_cli.py", own)[0]
    helper = "import asyncio\nasync def go():\n    await asyncio.create_subprocess_exec('sleep', '100')\n"
    assert "outside ddiloco/cli/processes.py" in file_violations("tests/unit/test_new.py", helper)[0]
    unbounded = 'subprocess.run([sys.executable, "-m", "services.learner.evaluator", "--once"], check=True)\n'
    assert "without timeout=" in file_violations("tests/integration/test_new.py", unbounded)[0]
    allowed = ('subprocess.run([sys.executable, "-m", "services.learner.evaluator", "--once"], timeout=60)\n'
               'cluster.add("syncer-2", "services.syncer", ["--bind", "127.0.0.1:0"]).start()\n'
               'subprocess.run(["git", "rev-parse", "HEAD"])\n'
               'proc = subprocess.Popen([*_DDILOCO, "record", "--target", address])\n')
    assert file_violations("tests/integration/test_record.py", allowed) == []
    assert file_violations(LAUNCHER, "self.proc = subprocess.Popen(list(argv))\n") == []
