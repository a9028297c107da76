"""The batched Kokoro forward pass (`voicebus.synthesis.batch`): each item's durations and audio
are those of kokoro's own `KModel.forward_with_tokens` run on it alone, on the tiny
random-weight model (real kokoro code)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

# Audio of the tiny model peaks near 2.5; batched and single differ by float rounding only
# (about 3e-6 measured on a 2-core AMD EPYC).
AUDIO_ATOL = 1e-4


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a CPU shared with other processes, two threads wait at every op for
    a core someone else holds (several times slower); the test's own setting is restored."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _requests(model, phonemes: list[str], speeds: list[float]):
    from voicebus.synthesis.batch import Request
    from voicebus.synthesis.kokoro_frames import token_ids

    noise = torch.Generator().manual_seed(1)
    return [Request(token_ids(model, p)[0], torch.randn(1, 256, generator=noise) * 0.5, speed)
            for p, speed in zip(phonemes, speeds)]


def test_each_item_of_a_batch_speaks_as_it_would_alone(tiny_engine):
    from voicebus.synthesis.batch import forward_batch

    model = tiny_engine.model
    # different lengths (padding in tokens and frames), speeds (durations), voices (styles)
    requests = _requests(model, ["həlˈoʊ.", "aɪ", "ɡʊd!"], [1.0, 0.8, 1.25])
    torch.manual_seed(5)  # the harmonic source's noise: drawn item by item, as one after another
    singles = [model.forward_with_tokens(r.input_ids[None], r.ref_s, r.speed) for r in requests]
    torch.manual_seed(5)
    batch = forward_batch(model, requests)

    assert len(batch) == len(requests)
    for (audio, durations), result in zip(singles, batch):
        assert torch.equal(result.durations, durations.reshape(-1))
        assert result.audio.shape == audio.reshape(-1).shape == (int(durations.sum()) * 600,)
        assert (result.audio - audio.reshape(-1)).abs().max().item() <= AUDIO_ATOL


def test_a_batch_of_one_is_kokoros_forward_pass(tiny_engine):
    from voicebus.synthesis.batch import forward_batch

    model = tiny_engine.model
    (request,) = _requests(model, ["siː."], [1.0])
    torch.manual_seed(3)
    audio, durations = model.forward_with_tokens(request.input_ids[None], request.ref_s)
    torch.manual_seed(3)
    (result,) = forward_batch(model, [request])
    assert torch.equal(result.durations, durations.reshape(-1))
    assert (result.audio - audio.reshape(-1)).abs().max().item() <= AUDIO_ATOL


def test_requests_it_cannot_take_are_refused(tiny_engine):
    from voicebus.synthesis.batch import BatchError, Request, forward_batch

    model = tiny_engine.model
    with pytest.raises(BatchError):
        forward_batch(model, [])
    too_long = Request(torch.ones(model.context_length + 1, dtype=torch.long), torch.zeros(1, 256))
    with pytest.raises(BatchError):
        forward_batch(model, [too_long])


def test_length_buckets_group_similar_lengths_up_to_the_batch_size():
    from voicebus.synthesis.batch import BatchError, length_buckets

    assert length_buckets([40, 5, 12, 33, 17, 9], max_batch=2, step=16) == [[1, 5], [2], [4], [3, 0]]
    assert length_buckets([], max_batch=4) == []
    with pytest.raises(BatchError):
        length_buckets([3], max_batch=0)
