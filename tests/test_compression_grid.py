"""The chunk grid and tier regions: tier slices are cut into the universal tensor's chunks."""

from __future__ import annotations

import pytest
import torch
from support.models import tiny_config

from matformer.modeling.compression import (
    ChunkGrid,
    CompressionConfig,
    full_region,
    region_slices,
    tier_region,
    tier_regions,
    universal_shapes,
)
from matformer.modeling.errors import RegionError

FFN = ("gate_proj", "up_proj", "down_proj")


def test_chunk_shape_is_clipped_to_small_dimensions():
    assert ChunkGrid.of((512,), 64).chunk == (64,)
    assert ChunkGrid.of((2048, 512), 64).chunk == (64, 64)
    assert ChunkGrid.of((32, 1000), 64).chunk == (32, 64)
    assert ChunkGrid.of((32, 1000), 64).counts == (1, 16)  # the last column chunk is partial


def test_chunk_ids_are_row_major_on_the_universal_grid():
    grid = ChunkGrid.of((192, 128), 64)  # 3 x 2 chunks
    assert grid.chunk_ids(full_region((192, 128))).tolist() == [0, 1, 2, 3, 4, 5]
    assert grid.chunk_ids(((0, 96), (0, 128))).tolist() == [0, 1, 2, 3]  # rows [:96]
    assert grid.chunk_ids(((64, 192), (64, 128))).tolist() == [3, 5]
    down = ChunkGrid.of((128, 192), 64)  # 2 x 3 chunks; columns [:64]
    assert down.chunk_ids(((0, 128), (0, 64))).tolist() == [0, 3]


def test_partial_edge_chunks_are_zero_padded_and_cropped_back():
    grid = ChunkGrid.of((192, 100), 64)
    region = ((0, 96), (0, 100))  # ends mid-chunk in both dimensions
    values = torch.randn(96, 100)
    blocks = grid.blocks(values, region)  # (4, 64, 64)
    assert blocks.shape == (4, 64, 64)
    assert torch.equal(blocks[3, :32, :36], values[64:, 64:])
    assert not blocks[3, 32:].any() and not blocks[3, :, 36:].any()
    assert torch.equal(grid.assemble(blocks, region), values)


def test_locate_finds_positions_in_region_order_and_flags_outsiders():
    grid = ChunkGrid.of((192, 128), 64)
    region = ((64, 192), (0, 128))  # chunks 2, 3, 4, 5
    assert grid.locate(torch.tensor([5, 2, 0, 3]), region).tolist() == [3, 0, -1, 1]


@pytest.mark.parametrize("tier", [1, 2])
def test_tier_slice_chunks_equal_the_universal_chunks(tier):
    config = tiny_config(intermediate_size=128)
    shapes = universal_shapes(config)
    regions = tier_regions(shapes, config, tier)
    dct = CompressionConfig(chunk=16, value_dtype="float32").build()
    for which in FFN:
        name = f"model.layers.1.mlp.{which}.weight"
        universal = torch.randn(shapes[name])
        grid = ChunkGrid.of(shapes[name], 16)
        region = regions[name]
        ids = grid.chunk_ids(region)
        sliced = universal[region_slices(region)].clone()  # what a tier-sliced client holds
        full = grid.blocks(universal, full_region(shapes[name]))  # every chunk, in id order
        assert torch.equal(grid.blocks(sliced, region), full[ids])
        # so a sliced client's DCT coefficients are the universal ones for the same chunks
        mine = dct.encode(name, sliced, shape=shapes[name], region=region, tokens=1)
        whole = dct.encode(name, universal, shape=shapes[name], region=full_region(
            shapes[name]), tokens=1)
        assert torch.equal(mine.chunks, ids)
        assert torch.equal(mine.values, whole.values[ids])
        assert torch.equal(mine.indices, whole.indices[ids])


def test_tier_regions_narrow_ffn_rows_and_down_columns_only():
    config = tiny_config(intermediate_size=64)
    shapes = universal_shapes(config)
    for tier, width in ((0, 64), (1, 32), (2, 16)):
        regions = tier_regions(shapes, config, tier)
        assert regions["model.layers.0.mlp.up_proj.weight"] == ((0, width), (0, 32))
        assert regions["model.layers.0.mlp.gate_proj.weight"] == ((0, width), (0, 32))
        assert regions["model.layers.0.mlp.down_proj.weight"] == ((0, 32), (0, width))
        assert regions["model.embed_tokens.weight"] == ((0, 96), (0, 32))
        assert regions["model.layers.1.input_layernorm.weight"] == ((0, 32),)
    name = "model.layers.1.mlp.down_proj.weight"
    assert tier_region(name, shapes[name], config, 2) == ((0, 32), (0, 16))
    mixed = tier_regions(shapes, config, [0, 2])  # Mix'n'Match
    assert mixed["model.layers.0.mlp.down_proj.weight"] == ((0, 32), (0, 64))
    assert mixed["model.layers.1.mlp.down_proj.weight"] == ((0, 32), (0, 16))


def test_universal_shapes_of_a_sliced_config_are_the_universal_ones():
    sliced = tiny_config(intermediate_size=32, matformer_tier=1)
    assert universal_shapes(sliced) == universal_shapes(tiny_config(intermediate_size=64))
    assert universal_shapes(sliced)["model.layers.0.mlp.up_proj.weight"] == (64, 32)


@pytest.mark.parametrize(
    ("region", "message"),
    [
        (((0, 96),), "one \\[start, stop\\) pair per dimension"),
        (((0, 200), (0, 128)), "outside shape"),
        (((64, 64), (0, 128)), "empty"),
        (((32, 96), (0, 128)), "off the chunk grid"),
    ],
)
def test_bad_regions_are_named_errors(region, message):
    with pytest.raises(RegionError, match=message):
        ChunkGrid.of((192, 128), 64).check_region(region)
