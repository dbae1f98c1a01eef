"""ul.sweep(world_sizes=...) with FSDP2 ranks that offload their parameters (fsdp_options={'offload_params': True})."""

import udnn_lab as ul

H100 = "h100-sxm"  # ranks of a GPU cluster, whatever this machine has

MLP = dict(batch=4, optimizer="adam")


def test_an_offloading_rank_counts_what_the_nodes_ranks_keep_in_host_memory():
    options = {"offload_params": True}
    table = ul.sweep("mlp3", ["40MiB"], world_sizes=[2, 4], setups=["FSDP2"], ranks_per_node=2, progress=False,
                     fsdp_options=options, **MLP, hardware=H100)
    for row in table.itertuples():
        graph = ul.trace(ul.zoo.get("mlp3", device="meta", **MLP), device="cuda",
                         parallel=ul.FSDP(row.world_size, **options))
        assert row.host_bytes_per_node == 2 * graph.host_peak_bytes and row.fits
        assert row.peak_bytes == graph.cuda_peak_bytes
        assert "parameters offloaded to the host" in row.spec
    tight = ul.sweep("mlp3", ["40MiB"], world_sizes=[2], setups=["FSDP2"], ranks_per_node=2, progress=False,
                     fsdp_options=options, host_budget="1MiB", **MLP, hardware=H100)
    assert not tight.fits.iloc[0] and "host memory" in tight.why.iloc[0]
