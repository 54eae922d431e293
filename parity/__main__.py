import sys

from .cli import main


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["bstar"]:
        from .bstar import main as bstar_main

        return bstar_main(argv[1:])
    return main(argv)


sys.exit(_dispatch(sys.argv[1:]))
