"""Does this image's vLLM accept these `vllm serve` argvs? Its own CLI parser and its serve checks, as `vllm serve`
runs them before anything loads: no engine, no model, no port. Run in the place that will serve, so the vLLM asked is
the one that would refuse.

usage: python3 -c SOURCE JSON   (JSON: a list of argvs, each without the leading "vllm": ["serve", MODEL, ...])
-> {"checked": bool, "refused": [str or None per argv], "why_unchecked": str, "vllm": str}
"""
import contextlib
import io
import json
import sys


def _parser():
    """vLLM's own `vllm serve` parser as its CLI main builds it (the import path moved across versions)."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    import vllm.entrypoints.cli.serve as serve

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    commands = {}
    for cmd in serve.cmd_init():
        cmd.subparser_init(subparsers)
        commands[cmd.name] = cmd
    return parser, commands


def _refused(parser, commands, argv):
    """None where vLLM accepts the argv, else its own last words (argparse's error line or the check's message)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
        if getattr(args, "model_tag", None) is not None:
            args.model = args.model_tag
        commands[args.subparser].validate(args)
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return lines[-1] if lines else "argparse exited"
    except Exception as exc:  # the serve checks raise ValueError/TypeError on a value they refuse
        return f"{type(exc).__name__}: {exc}"
    return None


def main():
    argvs = json.loads(sys.argv[1])
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import vllm

            parser, commands = _parser()
    except Exception as exc:  # no vLLM or another CLI layout: nothing is known, the launch will tell
        return {"checked": False, "refused": [], "why_unchecked": f"{type(exc).__name__}: {exc}", "vllm": ""}
    with contextlib.redirect_stdout(sys.stderr):
        refused = [_refused(parser, commands, argv) for argv in argvs]
    return {"checked": True, "refused": refused, "why_unchecked": "", "vllm": getattr(vllm, "__version__", "?")}
