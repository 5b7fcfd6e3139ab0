"""`python -m hf_zero.options --markdown [options|deepspeed]`: print README's options table (default) or its
"DeepSpeed key -> hf_zero option" table; `--write README.md` puts both into the README's marked sections,
`--check README.md` exits 1 when the README's tables differ from the declarations."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .. import deepspeed_config
from . import markdown, readme_section, replace_readme_section

TABLES: Dict[str, Callable[[], str]] = {"options": markdown, "deepspeed": deepspeed_config.markdown}


def main(argv: Optional[List[str]] = None) -> int:
    """Print, write or check the generated README tables."""
    parser = argparse.ArgumentParser(prog="python -m hf_zero.options", description=__doc__)
    parser.add_argument("--markdown", nargs="?", const="options", choices=sorted(TABLES),
                        help="print a table (default: options)")
    parser.add_argument("--write", metavar="README", help="replace the README's generated sections")
    parser.add_argument("--check", metavar="README", help="exit 1 when the README's generated sections are stale")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(TABLES[args.markdown]())
    for path, write in ((args.write, True), (args.check, False)):
        if not path:
            continue
        text = Path(path).read_text()
        new = text
        for name, table in TABLES.items():
            new = replace_readme_section(new, name, table())
        if write:
            Path(path).write_text(new)
        elif new != text:
            stale = [n for n, t in TABLES.items() if readme_section(text, n) != t()]
            print(f"{path}: the {', '.join(stale)} table(s) differ from the declarations; run "
                  f"`python -m hf_zero.options --write {path}`", file=sys.stderr)
            return 1
    if not (args.markdown or args.write or args.check):
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
