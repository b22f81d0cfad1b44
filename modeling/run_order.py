"""Which sequences a run trains, in what order, epoch after epoch, and which it holds out: the
one definition that standalone training (``client/epochs.py``), the coordinator's work queue
(``server/work.py``), ``matformer-eval``, the testnet's held-out loss and the ledger's audit
all take.

- **Candidates.** The MDAT shuffle of the run's seed, less the sequences that carry no
  target for the model (``with_targets``: a one-token document tail, for a causal model;
  a sequence of prompt alone, of instruction data).
- **Held out.** The last 5% of the candidates (at least one). No run ever trains on them,
  however long it runs, so a held-out loss is always measured on unseen sequences.
- **Epochs.** Epoch 0 takes the rest in the shuffle's order; each later epoch takes them in
  a fresh order drawn from the seed and the epoch's number, so a run that outlasts its data
  does not repeat one sequence of batches, and is the same every time it is run or resumed.

    reader, order = RunOrder.open(mdat, strategy, seq_len, view, seed, model_config)
    order.at(position)       # the id a run hands out at that position (over all epochs)
    order.epoch(2)           # epoch 2's ids, in its order
    order.held_out           # never trained
    order.evaluated(lengths, sequences=128, tokens=65_536)   # the held-out ids to evaluate

``RunOrder.fixed`` is the order of a federated run saved before this definition: every epoch
the same, nothing held out (its queue positions count in that order).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from matformer.modeling.config import ModelConfig
from matformer.modeling.errors import BatchError
from matformer.modeling.mdat import Mdat, SequenceReader
from matformer.modeling.training import with_targets

HELD_OUT_FRACTION = 0.05  # the tail of the candidates that no run trains on


class RunOrder:
    def __init__(self, training: Sequence[int] | np.ndarray,
                 held_out: Sequence[int] | np.ndarray = (), seed: int | None = None) -> None:
        self.training = np.asarray(training, dtype=np.int64)  # epoch 0, in its order
        self.held_out = np.asarray(held_out, dtype=np.int64)
        self.seed = seed  # of the later epochs' orders; None: every epoch is epoch 0
        if not len(self.training):
            raise BatchError("a run needs at least one sequence to train on besides the "
                             "one it holds out; give more data.")
        self._epochs = {0: self.training}

    @classmethod
    def of(cls, shuffle: np.ndarray, lengths: np.ndarray, config: ModelConfig,
           seed: int, responses: np.ndarray | None = None) -> RunOrder:
        """The order of a run over ``shuffle`` (sequence ids, ``lengths[i]`` tokens each;
        ``responses``: of instruction data, see ``with_targets``) for a model of ``config``.
        BatchError when nothing is left to train on."""
        ids = with_targets(np.asarray(shuffle), lengths, config, responses)
        held = max(1, int(len(ids) * HELD_OUT_FRACTION))
        return cls(ids[:len(ids) - held], ids[len(ids) - held:], seed)

    @classmethod
    def open(cls, mdat: Mdat, strategy: str, seq_len: int, view: str | None, seed: int,
             config: ModelConfig) -> tuple[SequenceReader, RunOrder]:
        """The run's sequences and its order, from the container it reads."""
        reader = mdat.sequences(strategy, seq_len, view)
        return reader, cls.of(mdat.shuffle(view, strategy, seq_len, seed), reader.lengths(),
                              config, seed, reader.response_lengths())

    @classmethod
    def fixed(cls, ids: Sequence[int] | np.ndarray) -> RunOrder:
        """``ids`` in the same order every epoch, nothing held out."""
        return cls(ids)

    def evaluated(self, lengths: np.ndarray, *, sequences: int, tokens: int) -> np.ndarray:
        """The held-out ids an evaluation reads: the tail's last ``sequences`` at most, fewer
        where their tokens (``lengths[i]`` each) would pass ``tokens`` (a training run's
        evaluation reads no more than it trains), and at least one unless ``sequences`` is 0:
        the same ids at every evaluation of a run."""
        tail = self.held_out[len(self.held_out) - min(sequences, len(self.held_out)):]
        within = np.cumsum(lengths[tail[::-1]]) <= tokens  # counted from the end
        kept = max(int(within.sum()), 1 if len(tail) else 0)
        return tail[len(tail) - kept:]

    @property
    def candidates(self) -> int:
        """Sequences that carry a target: trained and held out."""
        return len(self.training) + len(self.held_out)

    def epoch(self, number: int) -> np.ndarray:
        """Epoch ``number``'s training ids, in its order."""
        if number not in self._epochs:
            self._epochs[number] = self.training if self.seed is None else \
                np.random.default_rng([self.seed, number]).permutation(self.training)
        return self._epochs[number]

    def at(self, position: int) -> int:
        """The id at ``position`` of the run's sequence of epochs."""
        number, index = divmod(position, len(self.training))
        return int(self.epoch(number)[index])

    def handed_out(self, position: int) -> Counter[int]:
        """How often each training id is among the first ``position`` of the run."""
        passes, partial = divmod(position, len(self.training))
        counts = Counter({int(i): passes for i in self.training})
        counts.update(int(i) for i in self.epoch(passes)[:partial])
        return counts
