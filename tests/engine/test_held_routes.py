"""Router replay across a step's backwards (engine/participants.py ``RouterState``): a backward
that recomputes its forward routes its tokens as that forward did; with virtual pipeline stages
every chunk's backward of a micro-batch does, and the last of them (chunk 0's) lets the routes go."""

from types import SimpleNamespace

from megatron_psrl.engine.participants import RouterState
from megatron_psrl.schedule import instructions as ins


def test_every_chunk_backward_sets_the_held_routes_and_the_last_lets_them_go():
    set_calls = []
    runner = SimpleNamespace(replayer=SimpleNamespace(set=lambda *a: set_calls.append(a)), router_losses=None)
    step = SimpleNamespace(held_routes={3: ("routes of 3", None), 4: ("routes of 4", None)})
    state = RouterState(runner, training=True)
    state.before_graph_backward(ins.Backward(3, chunk=1), step)
    assert set_calls == [("routes of 3", None)] and 3 in step.held_routes  # chunk 0's backward is still to come
    state.before_graph_backward(ins.Backward(3, chunk=0), step)
    assert set_calls[-1] == ("routes of 3", None) and 3 not in step.held_routes
    state.before_graph_backward(ins.Backward(4), step)  # every chunk at once: let go
    assert set_calls[-1] == ("routes of 4", None) and not step.held_routes
    state.before_graph_backward(ins.Backward(5, chunk=1), step)  # nothing held: the routers' own
    assert len(set_calls) == 3
