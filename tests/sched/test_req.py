"""Req.token_ids: the prompt and outputs, from a buffer that copies only the outputs added
since the last call."""

import numpy as np
import torch

from memcli.sched.req import Req


def joined(req, n):
    return np.concatenate([req.origin_input_ids, np.asarray(req.output_ids, dtype=np.int64)])[:n]


def test_token_ids_follow_appends_extends_and_a_replaced_output_list():
    rng = np.random.default_rng(7)
    req = Req("r", rng.integers(0, 1000, 37), 300, torch.device("cpu"))
    views = []
    for round_ in range(60):
        grow = int(rng.integers(0, 9))
        if round_ % 7 == 3:
            req.output_ids.extend(int(t) for t in rng.integers(0, 1000, grow))
        else:
            for _ in range(grow):
                req.output_ids.append(int(rng.integers(0, 1000)))
        if round_ == 40:  # a new list (as a runner that sets the outputs at once does)
            req.output_ids = [int(t) for t in rng.integers(0, 1000, len(req.output_ids))]
        total = req.input_len + len(req.output_ids)
        for n in (0, 5, req.input_len, total - 1, total, total + 3):
            got = req.token_ids(max(n, 0))
            assert got.dtype == np.int64
            assert np.array_equal(got, joined(req, max(n, 0))), (round_, n)
        views.append((req.token_ids(total).copy(), req.token_ids(total)))
    for before, view in views:  # an earlier answer is never written by a later call
        assert np.array_equal(before, view)


def test_token_ids_past_the_outputs_stop_at_the_tokens_there_are():
    req = Req("r", np.arange(10), 4, torch.device("cpu"))
    req.output_ids.extend([100, 101])
    assert req.token_ids(50).tolist() == [*range(10), 100, 101]
    assert req.token_ids(4).tolist() == [0, 1, 2, 3]


def test_a_prompt_with_room_after_it_is_the_token_buffer():
    from memcli.workload.spec import RequestSpec

    spec = RequestSpec(rid="r", input_len=10, output_len=6, hash_ids=(3, 4, 5), block_size=4)
    plain, roomy = spec.input_ids(), spec.input_ids(room=6)
    assert roomy.tolist() == plain.tolist() == [12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    assert roomy.base is not None and roomy.base.shape[0] >= 16
    req = Req("r", roomy, 6, torch.device("cpu"))
    req.output_ids.extend([100, 101, 102])
    tokens = req.token_ids(13)
    assert tokens.tolist() == plain.tolist() + [100, 101, 102]
    assert req._tokens is roomy.base  # no buffer of its own: the prompt was not copied
    req.output_ids.extend([103, 104, 105])
    assert req.token_ids(16).tolist() == plain.tolist() + [100, 101, 102, 103, 104, 105]
    assert req._tokens is roomy.base
    exact = RequestSpec(rid="e", input_len=12, output_len=6, hash_ids=(3, 4, 5), block_size=4).input_ids()
    assert Req("e", exact, 6, torch.device("cpu"))._tokens is None  # no room after the prompt: a buffer when needed


def test_memcli_format_prompts_with_room():
    from memcli.workload.spec import RequestSpec

    spec = RequestSpec(rid="r", input_len=5, output_len=2, token_runs=(range(7, 10), np.array([1, 2], dtype=np.int64)))
    assert spec.input_ids().tolist() == spec.input_ids(room=2).tolist() == [7, 8, 9, 1, 2]
    assert spec.input_ids().base is None and spec.input_ids(room=2).base.shape[0] == 7
