"""GPU catalog.

Every figure comes from the NVIDIA datasheet or whitepaper named next to it.
Conventions:

* ``hbm_bytes``: the vendor's "NN GB" is taken as NN GiB (see ``types.py``).
* ``bf16_flops``: dense tensor-core peak, i.e. the datasheet's "with sparsity"
  figure halved where only that one is printed.
* Bandwidths in bytes/s, 1 GB/s = 1e9 B/s. NVLink and PCIe datasheet figures are
  bidirectional totals; ``intra_node_bw`` is one direction (half of it).
* ``network_bw`` is a typical inter-node figure per GPU, per direction: the
  reference node's NICs divided by its GPUs (e.g. DGX A100: 8 x 200 Gb/s HDR
  InfiniBand for 8 GPUs = 25 GB/s per GPU). Consumer/inference cards have no
  reference node; the value there is an assumption stated in the comment.
"""

from __future__ import annotations

from fleetserve.spec.types import GpuSpec

GiB = 2**30
GB = 10**9
TFLOPS = 1e12
Gbit = 1e9 / 8  # bytes/s in one Gb/s

GPUS: dict[str, GpuSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB),
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    # and "NVIDIA A100 Tensor Core GPU Architecture" whitepaper (SXM4 40GB: 1,555 GB/s).
    "a100-40gb": GpuSpec(
        name="a100-40gb",
        hbm_bytes=40 * GiB,  # 40GB HBM2
        bf16_flops=312 * TFLOPS,  # BF16 tensor 312 TFLOPS dense (624 with sparsity)
        hbm_bw=1555 * GB,  # 1,555 GB/s
        intra_node_link="nvlink",
        intra_node_bw=300 * GB,  # NVLink 3: 600 GB/s bidirectional -> 300 GB/s per direction
        network_bw=200 * Gbit,  # DGX A100: 8 x 200 Gb/s HDR IB for 8 GPUs -> 25 GB/s per GPU
        gpus_per_node=8,
    ),
    # NVIDIA A100 datasheet (SXM4 80GB), same URL as above.
    "a100-80gb": GpuSpec(
        name="a100-80gb",
        hbm_bytes=80 * GiB,  # 80GB HBM2e
        bf16_flops=312 * TFLOPS,  # BF16 tensor 312 TFLOPS dense
        hbm_bw=2039 * GB,  # 2,039 GB/s (SXM4 80GB)
        intra_node_link="nvlink",
        intra_node_bw=300 * GB,  # NVLink 600 GB/s bidirectional
        network_bw=200 * Gbit,  # DGX A100 80GB: 8 x 200 Gb/s HDR IB -> 25 GB/s per GPU
        gpus_per_node=8,
    ),
    # NVIDIA A800 Tensor Core GPU datasheet (SXM4 80GB), China export variant of the
    # A100 80GB: same compute and HBM, NVLink cut to 400 GB/s.
    # https://www.nvidia.cn/content/dam/en-zz/Solutions/Data-Center/a800/pdf/a800-datasheet-nvidia-a4-2553580-r2-zhCN.pdf
    "a800-80gb": GpuSpec(
        name="a800-80gb",
        hbm_bytes=80 * GiB,  # 80GB HBM2e
        bf16_flops=312 * TFLOPS,  # BF16 tensor 312 TFLOPS dense
        hbm_bw=2039 * GB,  # 2,039 GB/s
        intra_node_link="nvlink",
        intra_node_bw=200 * GB,  # NVLink 400 GB/s bidirectional -> 200 GB/s per direction
        network_bw=200 * Gbit,  # HGX A800 nodes: 200 Gb/s HDR IB per GPU -> 25 GB/s
        gpus_per_node=8,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM),
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    "h100-80gb": GpuSpec(
        name="h100-80gb",
        hbm_bytes=80 * GiB,  # 80GB HBM3
        bf16_flops=989.4 * TFLOPS,  # BF16 tensor 1,979 TFLOPS with sparsity -> 989.4 dense
        hbm_bw=3350 * GB,  # 3.35 TB/s
        intra_node_link="nvlink",
        intra_node_bw=450 * GB,  # NVLink 4: 900 GB/s bidirectional -> 450 GB/s per direction
        network_bw=400 * Gbit,  # DGX H100: 8 x 400 Gb/s NDR (ConnectX-7) -> 50 GB/s per GPU
        gpus_per_node=8,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM),
    # https://resources.nvidia.com/en-us-data-center-overview-mc/en-us-data-center-overview/hpc-datasheet-sc23-h200
    "h200-141gb": GpuSpec(
        name="h200-141gb",
        hbm_bytes=141 * GiB,  # 141GB HBM3e (vendor GB taken as GiB, like every entry)
        bf16_flops=989.4 * TFLOPS,  # BF16 tensor 1,979 TFLOPS with sparsity -> 989.4 dense
        hbm_bw=4800 * GB,  # 4.8 TB/s
        intra_node_link="nvlink",
        intra_node_bw=450 * GB,  # NVLink 900 GB/s bidirectional
        network_bw=400 * Gbit,  # DGX H200: 8 x 400 Gb/s NDR -> 50 GB/s per GPU
        gpus_per_node=8,
    ),
    # "NVIDIA Ada GPU Architecture" whitepaper, Appendix A (GeForce RTX 4090),
    # https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf
    "rtx4090-24gb": GpuSpec(
        name="rtx4090-24gb",
        hbm_bytes=24 * GiB,  # 24 GB GDDR6X (not HBM; the field is device memory)
        # BF16/FP16 tensor with FP32 accumulate: 165.2 TFLOPS dense (330.4 sparse). The
        # FP16-accumulate figure (330.3) is not what bf16/fp16 serving kernels get.
        bf16_flops=165.2 * TFLOPS,
        hbm_bw=1008 * GB,  # 1,008 GB/s
        intra_node_link="pcie",  # no NVLink on Ada consumer cards
        intra_node_bw=32 * GB,  # PCIe Gen4 x16: 64 GB/s bidirectional -> 32 GB/s per direction
        # Assumption: 8-GPU server with one 200 Gb/s NIC shared by 8 GPUs -> 3.125 GB/s per GPU.
        network_bw=200 * Gbit / 8,
        gpus_per_node=8,
    ),
    # NVIDIA V100 Tensor Core GPU datasheet (SXM2 32GB),
    # https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
    "v100-32gb": GpuSpec(
        name="v100-32gb",
        hbm_bytes=32 * GiB,  # 32 GB HBM2
        # V100 has no bf16: this is the FP16 tensor-core peak (SXM2: 125 TFLOPS, dense;
        # Volta has no sparsity support). Models run in fp16 on it.
        bf16_flops=125 * TFLOPS,
        hbm_bw=900 * GB,  # 900 GB/s
        intra_node_link="nvlink",
        intra_node_bw=150 * GB,  # NVLink 2: 300 GB/s bidirectional -> 150 GB/s per direction
        network_bw=4 * 100 * Gbit / 8,  # DGX-1V: 4 x 100 Gb/s EDR IB for 8 GPUs -> 6.25 GB/s
        gpus_per_node=8,
    ),
    # NVIDIA L4 Tensor Core GPU datasheet,
    # https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet
    "l4-24gb": GpuSpec(
        name="l4-24gb",
        hbm_bytes=24 * GiB,  # 24GB GDDR6
        bf16_flops=121 * TFLOPS,  # BF16 tensor 242 TFLOPS with sparsity -> 121 dense
        hbm_bw=300 * GB,  # 300 GB/s
        intra_node_link="pcie",
        intra_node_bw=32 * GB,  # PCIe Gen4 x16: 64 GB/s bidirectional -> 32 GB/s per direction
        # Assumption: 8 x L4 server (e.g. GCP g2-standard-96) with 100 Gb/s -> 1.5625 GB/s per GPU.
        network_bw=100 * Gbit / 8,
        gpus_per_node=8,
    ),
}
