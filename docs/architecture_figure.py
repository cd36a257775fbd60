"""Draw docs/architecture.png, the propose path of docs/architecture.md.

    python3 docs/architecture_figure.py        # needs matplotlib; writes docs/architecture.png
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

TARGET = "#dbe9f6"
WIRE = "#fde9c8"
SERVER = "#e2f0d9"
GPU = "#f4d6d6"

# (x, y, text, colour): x, y are the box centre in axis units (0-10 wide, 0-12 tall)
BOXES = {
    "step": (2.45, 11.2, "target step\nvLLM (drafter_vllm/) or coordinator/target/", TARGET),
    "proposer": (2.45, 9.7, "client record: ProposeRequest, request_drafts\ncoordinator/remote_proposer.py", TARGET),
    "encode": (2.45, 8.2, "wire encode\ncoordinator/transport/zmq_client.py | grpc_client.py\n"
                         "drafter/wire/tensors.py | pbwire.py", WIRE),
    "decode": (8.45, 8.2, "server decode\ndrafter/service/zmq_server.py | grpc_server.py", WIRE),
    "session": (8.45, 6.8, "session check: serve_propose\ndrafter/service/core.py, sessions.py", SERVER),
    "batch": (8.45, 5.4, "batching: queue, checks, fuse, stage, runner\ndrafter/service/batching/", SERVER),
    "engine": (8.45, 4.0, "engine: DraftEngine.draft(inputs)\ndrafter/engine/engine.py, inputs.py", SERVER),
    "graphs": (8.45, 2.6, "header write + graph replay\ndrafter/engine/graphs.py", GPU),
    "kernels": (8.45, 1.2, "Triton kernels\ndrafter/kernels/", GPU),
    "back": (2.45, 2.6, "client decode: drafts [batch, k]\nthe target verifies them next step", TARGET),
}
ARROWS = [("step", "proposer", ""), ("proposer", "encode", ""), ("encode", "decode", "ZMQ / gRPC"),
          ("decode", "session", ""), ("session", "batch", ""), ("batch", "engine", ""),
          ("engine", "graphs", ""), ("graphs", "kernels", ""), ("engine", "back", "drafts back")]
W, H = 4.7, 1.0


def draw(path: Path) -> None:
    """Boxes for the stages, arrows for the calls between them."""
    fig, ax = plt.subplots(figsize=(12, 9))
    ax.set_xlim(-0.1, 10.9)
    ax.set_ylim(0.4, 12)
    ax.axis("off")
    ax.text(2.45, 11.9, "target process (coordinator/)", ha="center", fontsize=11, weight="bold")
    ax.text(8.45, 9.3, "drafter process (drafter/)", ha="center", fontsize=11, weight="bold")
    for x, y, text, colour in BOXES.values():
        ax.add_patch(FancyBboxPatch((x - W / 2, y - H / 2), W, H, boxstyle="round,pad=0.05",
                                    facecolor=colour, edgecolor="#555555"))
        ax.text(x, y, text, ha="center", va="center", fontsize=8, family="monospace")
    for a, b, label in ARROWS:
        (xa, ya, *_), (xb, yb, *_) = BOXES[a], BOXES[b]
        start = (xa + W / 2, ya) if xb > xa else (xa - W / 2, ya) if xb < xa else (xa, ya - H / 2 - 0.05)
        end = (xb - W / 2, yb) if xb > xa else (xb + W / 2, yb) if xb < xa else (xb, yb + H / 2 + 0.05)
        ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", lw=1.4))
        if label:
            ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.2, label, ha="center", backgroundcolor="white", fontsize=9)
    fig.savefig(path, dpi=90, bbox_inches="tight")


if __name__ == "__main__":
    draw(Path(__file__).with_name("architecture.png"))
