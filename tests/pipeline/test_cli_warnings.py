"""The CLI hides the known torch warnings of every `synth`/worker run, and only those, and only
while a command runs."""

from __future__ import annotations

import warnings

from voicebus import cli


def emit(message: str, category: type[Warning], module: str) -> None:
    warnings.warn_explicit(message, category, filename=module.replace(".", "/") + ".py", lineno=1, module=module)


TORCH = [
    ("`torch.nn.utils.weight_norm` is deprecated in favor of `torch.nn.utils.parametrizations.weight_norm`.",
     FutureWarning, "torch.nn.utils.weight_norm"),
    ("`torch.jit.script` is deprecated. Please switch to `torch.compile` or `torch.export`.",
     FutureWarning, "torch.jit._script"),
    ("dropout option adds dropout after all but last recurrent layer, so non-zero dropout expects num_layers "
     "greater than 1, but got dropout=0.2 and num_layers=1", UserWarning, "torch.nn.modules.rnn"),
]


def test_known_third_party_warnings_are_hidden_while_a_command_runs_and_others_shown():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with cli.quiet_third_party_warnings():
            for warning in TORCH:
                emit(*warning)
            emit("something new in torch", FutureWarning, "torch.nn.modules.rnn")
            emit("`torch.jit.script` is deprecated", FutureWarning, "voicebus.synthesis.engine")  # ours: shown
        assert [str(w.message) for w in seen] == ["something new in torch", "`torch.jit.script` is deprecated"]
        emit(*TORCH[0])  # after the command: filters restored
        assert len(seen) == 3


def test_the_setting_shows_them_again():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with cli.quiet_third_party_warnings(show=True):
            for warning in TORCH:
                emit(*warning)
    assert len(seen) == len(TORCH)


def test_main_runs_commands_inside_the_filter(monkeypatch, capsys):
    seen_inside = []

    def fake(args, settings):
        seen_inside.append(any(f[0] == "ignore" and f[1] is not None and f[1].pattern.startswith("`torch")
                               for f in warnings.filters))
        return 0

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(func=fake)
    assert cli.main([]) == 0
    assert seen_inside == [True]
