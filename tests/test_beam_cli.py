"""``beam run FILE [options]`` (dataprep/beam_cli.py): the design's command for the pipeline, with Beam's
own pipeline options passed to the file; usage for anything else; a file that defines no pipeline refused
before anything runs."""

import sys
import textwrap

import pytest

from dataprep import beam_cli

PIPELINE = textwrap.dedent('''
    import argparse
    import sys

    import apache_beam as beam
    from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions, StandardOptions


    def run(argv=None):
        ap = argparse.ArgumentParser()
        ap.add_argument("--output", required=True)
        known, beam_args = ap.parse_known_args(argv)
        opts = PipelineOptions(beam_args)
        with open(known.output + ".options", "w") as f:
            f.write(f"{opts.view_as(StandardOptions).runner} {opts.view_as(GoogleCloudOptions).project} "
                    f"{opts.view_as(GoogleCloudOptions).temp_location} {__name__} {sys.argv[0]}")
        with beam.Pipeline(options=opts) as p:
            _ = (p | beam.Create([3, 1, 2]) | beam.Map(lambda x: x * 10)
                 | beam.io.WriteToText(known.output, shard_name_template=""))


    if __name__ == "__main__":
        run(sys.argv[1:])
        sys.exit(7)
''')


def test_run_runs_the_file_with_beams_own_pipeline_options(tmp_path):
    path = tmp_path / "pipe.py"
    path.write_text(PIPELINE)
    out = tmp_path / "out.txt"
    argv_before, path0 = list(sys.argv), sys.path[0]
    code = beam_cli.main(["run", str(path), "--output", str(out), "--runner", "DirectRunner",
                          "--project=my-project", "--temp_location", "gs://bucket/tmp"])
    assert code == 7  # the file's own exit status
    assert sorted(out.read_text().split()) == ["10", "20", "30"]
    assert (tmp_path / "out.txt.options").read_text() == f"DirectRunner my-project gs://bucket/tmp __main__ {path}"
    assert sys.argv == argv_before and sys.path[0] == path0


@pytest.mark.parametrize("argv,message", [
    ([], "no command"),
    (["frob"], "unknown command 'frob'"),
    (["run"], "no FILE after 'run'"),
    (["run", "--runner", "DirectRunner"], "no FILE after 'run'"),
])
def test_anything_else_prints_the_usage(argv, message, capsys):
    assert beam_cli.main(argv) == beam_cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: beam run FILE [options]") and f"beam: error: {message}" in err


def test_help_prints_the_usage_on_stdout(capsys):
    assert beam_cli.main(["--help"]) == 0 and beam_cli.main(["run", "-h"]) == 0
    assert capsys.readouterr().out.count("usage: beam run FILE [options]") == 2


@pytest.mark.parametrize("name,text,message", [
    ("plain.py", "import os\nif __name__ == '__main__':\n    print(os.getcwd())\n",
     "defines no Beam pipeline: it imports nothing of apache_beam."),
    ("lib.py", "import apache_beam as beam\n\ndef run(argv):\n    pass\n",
     'defines no Beam pipeline: it has no `if __name__ == "__main__":` block that runs the pipeline.'),
    ("both.py", "x = 1\n", "it imports nothing of apache_beam and it has no `if __name__"),
    ("bad.py", "def (:\n", "not a Python file (SyntaxError"),
    ("notes.md", "# notes\n", "not a Python file (.py)"),
    ("missing.py", None, "no such file"),
])
def test_a_file_that_defines_no_pipeline_is_refused_before_it_runs(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert beam_cli.main(["run", str(path), "--runner", "DirectRunner"]) == beam_cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"beam: error: {path}") and message in err
