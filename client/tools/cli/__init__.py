"""The `ngramcache` command line: one entry point, one subcommand per task; arguments and printing only, the work is the library's.

- `run`: `main`, which runs one command and turns every error into one line and an exit status.
- `parser`: every command, its flags and their help.
- `arguments`: argparse types and the options commands share.
- `guards`: checks of inputs and outputs before any work; the interruption report.
- `commands`: build, stats, inspect, merge, import-llama, export-llama, export-sglang.
- `demo`: the local part of `ngramcache demo`.
- `sglang`: sglang-sync, which keeps running SGLang servers' external corpora on a namespace's newest generation.
- `llama_follow`: llama-follow, which runs llama-server behind a proxy and moves it to each new generation.

Every command checks its arguments and its output path before any work, so a mistake costs
nothing and never destroys an input; a user error is one line on stderr (exit status 2),
Ctrl-C one line (exit status 130), and neither leaves a partial output behind.
"""

from ngramcache.client.tools.cli.arguments import (
           int_in,
           load_tokenizer_spec,
           seconds_in,
           tokenizer_options,
           vocab_and_fingerprint,
)
from ngramcache.client.tools.cli.demo import demo_inputs, demo_workdir, run_local_demo, sigint_ignored
from ngramcache.client.tools.cli.guards import check_input_file, check_output, check_outputs_against_inputs, describe_os_error
from ngramcache.client.tools.cli.parser import CommandHook, build_parser, json_option, package_version
from ngramcache.client.tools.cli.run import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_UNEXPECTED, main

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_UNEXPECTED", "CommandHook", "build_parser", "check_input_file",
           "check_output", "check_outputs_against_inputs", "demo_inputs", "demo_workdir", "describe_os_error",
           "int_in", "json_option", "load_tokenizer_spec", "main", "package_version", "run_local_demo", "seconds_in", "sigint_ignored",
           "tokenizer_options", "vocab_and_fingerprint"]
