"""`matformer-client`, the training client (DESIGN.md §1, §5).

The core, without transport: the rounds a client runs and the replica it keeps.

Public API:

device_name(device), memory_bytes(device),
measure_tokens_per_second(model, tier, *, sequence_length, batch_tokens, steps, seed)
    What a client reports when it joins: device, memory, measured tokens/s (probe.py).
Replica(model): .apply(round_update), .hash(tier=None); .regions, .shapes, .parameters,
.aliases
    The tier slice it holds, kept equal to the master by applying broadcast updates
    (replica.py).
LocalRound(replica, compressor, schedule, limits=None).run(sequences, step=0) -> RoundWork
(results, losses, tokens, seconds); trained_regions(shapes, config, tiers)
    Accumulated gradients at the schedule's tiers → one SparseResult per parameter through
    error feedback (local_round.py).
FeedbackState(compressor, shapes, regions): .save(path), .load(path)
    Every parameter's error-feedback momentum, as safetensors across restarts
    (feedback_state.py).

Errors (client.errors, all ClientError): ModelMismatch, FeedbackStateMismatch.
"""
