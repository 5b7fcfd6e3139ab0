"""`python -m hf_zero.options --write`: put the generated tables into their docs pages (the options table into
docs/configuration.md, the "DeepSpeed key -> hf_zero option" table into docs/from_deepspeed.md, between their
marker comments); `--check` exits 1 when a page's tables differ from the declarations; `--markdown
[options|deepspeed]` prints one table. `--write PAGE ...` / `--check PAGE ...` take other pages instead: each gets
every table whose markers it holds."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .. import deepspeed_config
from . import markdown, page_section, replace_page_section, section_markers

TABLES: Dict[str, Callable[[], str]] = {"options": markdown, "deepspeed": deepspeed_config.markdown}
# each table's home, relative to the repository root (the checkout this package is imported from)
PAGES: Dict[str, str] = {"options": "docs/configuration.md", "deepspeed": "docs/from_deepspeed.md"}
ROOT = Path(__file__).resolve().parents[2]


def _home_pages() -> List[Path]:
    pages = [ROOT / p for p in dict.fromkeys(PAGES.values())]
    missing = [str(p) for p in pages if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} not found (hf_zero is not imported from a checkout?): name the "
                                f"pages, e.g. `python -m hf_zero.options --write docs/configuration.md`")
    return pages


def _tables_in(text: str) -> List[str]:
    return [name for name in TABLES if section_markers(name)[0] in text]


def main(argv: Optional[List[str]] = None) -> int:
    """Print, write or check the generated tables."""
    parser = argparse.ArgumentParser(prog="python -m hf_zero.options", description=__doc__)
    parser.add_argument("--markdown", nargs="?", const="options", choices=sorted(TABLES),
                        help="print a table (default: options)")
    parser.add_argument("--write", nargs="*", metavar="PAGE",
                        help=f"replace the generated tables in their pages (default: {', '.join(PAGES.values())})")
    parser.add_argument("--check", nargs="*", metavar="PAGE",
                        help="exit 1 when a page's generated tables differ from the declarations (default: the same "
                             "pages)")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(TABLES[args.markdown]())
    status = 0
    for pages, write in ((args.write, True), (args.check, False)):
        if pages is None:
            continue
        try:
            paths = [Path(p) for p in pages] or _home_pages()
        except FileNotFoundError as exc:
            print(f"python -m hf_zero.options: {exc}", file=sys.stderr)
            return 2
        for path in paths:
            try:
                text = path.read_text()
            except OSError as exc:
                print(f"python -m hf_zero.options: {exc}", file=sys.stderr)
                return 2
            names = _tables_in(text)
            if not names:
                print(f"{path}: no generated table's markers (e.g. {section_markers('options')[0]})", file=sys.stderr)
                return 2
            new = text
            for name in names:
                new = replace_page_section(new, name, TABLES[name]())
            if write:
                if new != text:
                    path.write_text(new)
            elif new != text:
                stale = [n for n in names if page_section(text, n) != TABLES[n]()]
                again = f"--write {path}" if pages else "--write"
                print(f"{path}: the {', '.join(stale)} table(s) differ from the declarations; run "
                      f"`python -m hf_zero.options {again}`", file=sys.stderr)
                status = 1
    if not (args.markdown or args.write is not None or args.check is not None):
        parser.print_help()
    return status


if __name__ == "__main__":
    sys.exit(main())
