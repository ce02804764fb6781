"""Screenshots of the built docs site in headless Chromium, to look at the pages as a reader would.

Build the site first (``bash scripts/docs.sh``), then::

    python scripts/docs_screenshots.py                       # landing page, a guide, a reference page
    python scripts/docs_screenshots.py guides/vllm/ --height 3000

The site is served from ``site/`` on a local port and each page is written to
``build/screenshots/<page>.png``. Needs Debian's ``chromium`` (``apt-get install -y chromium``). A
tool for people, not part of CI.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PAGES = ["", "guides/export/", "reference/"]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no line per request
        pass


def _serve(site: Path) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _shoot(browser: str, url: str, out: Path, width: int, height: int) -> None:
    with tempfile.TemporaryDirectory(prefix="kha-chromium-") as profile:  # a fresh profile each time
        cmd = [
            browser,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "--virtual-time-budget=4000",
            f"--screenshot={out}",
            url,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"chromium failed on {url} (exit {done.returncode}):\n{done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", default=DEFAULT_PAGES, help="page paths under the site ('' = landing)")
    parser.add_argument("--site", type=Path, default=ROOT / "site", help="the built site (default: site/)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "screenshots")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=1800)
    args = parser.parse_args(argv)

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium is not installed: apt-get install -y chromium")
    if not (args.site / "index.html").is_file():
        raise SystemExit(f"no built site in {args.site}: run bash scripts/docs.sh first")
    args.out.mkdir(parents=True, exist_ok=True)
    server = _serve(args.site)
    try:
        for page in args.pages:
            name = page.strip("/").replace("/", "_") or "index"
            out = args.out / f"{name}.png"
            _shoot(browser, f"http://127.0.0.1:{server.server_port}/{page}", out, args.width, args.height)
            print(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out)
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
