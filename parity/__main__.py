import sys

from .cli import main


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["bstar"]:
        from .bstar import main as bstar_main

        return bstar_main(argv[1:])
    if argv[:1] == ["accounting"]:
        from .accounting_check import main as accounting_main

        return accounting_main(argv[1:])
    if argv[:1] == ["calibrate"]:
        from .calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv[:1] == ["determinism"]:
        from .determinism import main as determinism_main

        return determinism_main(argv[1:])
    if argv[:1] == ["scaling"]:
        from .scaling import main as scaling_main

        return scaling_main(argv[1:])
    return main(argv)


sys.exit(_dispatch(sys.argv[1:]))
