"""LMM replicas on a local Ray cluster (2 CPUs): two replicas of a tiny random LLaVA (fp32) answer image, video,
text and adapter requests through the front with one engine's greedy tokens; a replica killed mid-stream loses
none of them (each resumes on the other replica, which encodes its images again)."""

from __future__ import annotations

import pytest

from tests.cluster.test_cluster import greedy, kill_until_a_request_moves
from tests.models.test_vision import CASES, IMG, TPI, make_tiny_llava, with_adapters
from vlora import LLM, SamplingParams
from vlora.engine.client import Job, VisionInfo

ray = pytest.importorskip("ray")


def test_vision_info_counts_the_tokens_images_add():
    info = VisionInfo((IMG,), TPI)
    assert info.prompt_tokens_added(None) == 0
    assert info.prompt_tokens_added(["image"]) == TPI - 1
    assert info.prompt_tokens_added(["image", ["f0", "f1", "f2"]]) == 4 * TPI - 2    # a video: a token run per frame
    assert VisionInfo((IMG,), None).prompt_tokens_added(["image"]) == 0          # Qwen2-VL: by size, on admission


def test_a_resumed_request_whose_output_holds_the_placeholder_id_is_not_read_as_images(tmp_path):
    """A request the front moves resumes as prompt + output so far (``resumed``: how many tokens are output):
    output tokens that happen to be the image placeholder id stay tokens, and the continuation is the one the
    request would have had (a bias makes the placeholder id the model's pick)."""
    from vlora.engine.engine import RequestError

    path, _ = make_tiny_llava(tmp_path)
    llm = LLM(str(path), block_size=4, max_model_len=192, num_blocks=256, device="cpu", dtype="float32")
    prompt, images, _ = CASES[0]
    sp = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, logit_bias={IMG: 0.5})   # noqa: E731
    whole = llm.generate(prompt, None, sp(8), images=images)[0]
    assert whole.token_ids[:3].count(IMG) == 3
    eng = llm.engine
    rid = eng.add_request(prompt + whole.token_ids[:3], None, sp(5), images=images, resumed=3)
    out = {}
    while eng.has_unfinished():
        out.update((o.request_id, o) for o in eng.step() if o.finished)
    assert out[rid].token_ids == whole.token_ids[3:]
    assert out[rid].prompt_token_ids == whole.prompt_token_ids + whole.token_ids[:3]
    with pytest.raises(RequestError, match="placeholder"):         # not said to be output: read as placeholders
        eng.add_request(prompt + whole.token_ids[:3], None, sp(5), images=images)


def test_lmm_replicas_answer_like_one_engine_and_a_killed_one_loses_no_image_request(tmp_path):
    path, hf = make_tiny_llava(tmp_path)
    paths, _ = with_adapters(tmp_path, hf)
    kw = dict(adapters={k: str(v) for k, v in paths.items()}, block_size=4, max_model_len=192, num_blocks=256,
              device="cpu", dtype="float32")
    one = LLM(str(path), **kw)
    prompts, images, names = (list(x) for x in zip(*CASES))
    want = [o.token_ids for o in one.generate(prompts, names, greedy(6), images=images)]
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        two = LLM(str(path), replicas=2, **kw)
        try:
            client = two.cluster
            front = client.front
            assert front.info.vision == VisionInfo((IMG,), TPI)
            assert [o.token_ids for o in two.generate(prompts, names, greedy(6), images=images)] == want

            # long enough that the victim seldom finishes its requests before the kill lands
            kill_until_a_request_moves(
                client, front.replicas[0],
                lambda attempt: [Job(p, a, greedy(120), f"lmm-kill-{attempt}-{i}", tuple(im) if im else None)
                                 for i, (p, im, a) in enumerate(CASES)],
                [o.token_ids for o in one.generate(prompts, names, greedy(120), images=images)])
        finally:
            two.close()
    finally:
        ray.shutdown()
