"""The robot interface the control loop talks to, and a mock for tests and dry runs."""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Robot(ABC):
    """A robot or simulator. Contract:
    - `observation_features` / `action_features`: name -> shape of what get_observation returns and what
      send_action takes;
    - `get_observation()` returns a dict of numpy arrays (at least "state");
    - `send_action(a)` commands a *position target* and returns the action actually sent after safety
      clipping (so the caller logs what the robot really got);
    - `safe_stop()` holds the current position with motors commanded to stay; idempotent;
    - usable as a context manager (connect on enter, disconnect on exit)."""

    observation_features: dict
    action_features: dict

    @abstractmethod
    def connect(self) -> None: ...

    @abstractmethod
    def get_observation(self) -> dict: ...

    @abstractmethod
    def send_action(self, action: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def safe_stop(self) -> None: ...

    @abstractmethod
    def disconnect(self) -> None: ...

    def hold_position(self, obs: dict) -> np.ndarray:
        """The action that holds the robot where it stands (the loop sends it until the first chunk lands).
        Default: the leading action-sized part of obs["state"] (positions first, then anything else)."""
        state = np.asarray(obs["state"], dtype=np.float64)
        dims = int(sum(np.prod(v) for v in getattr(self, "action_features", {}).values())) or len(state)
        return state[:dims].copy()

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc):
        self.disconnect()


class MockRobot(Robot):
    """D joints that move straight to the (clipped) position target; records everything it was sent."""

    def __init__(self, dims: int = 2, limit: float = 1.0):
        self.dims, self.limit = dims, limit
        self.observation_features = {"state": (dims,)}
        self.action_features = {"position": (dims,)}
        self.state = np.zeros(dims)
        self.sent: list[np.ndarray] = []
        self.stops = 0
        self.connected = False

    def connect(self) -> None:
        self.connected = True

    def get_observation(self) -> dict:
        if not self.connected:
            raise RuntimeError("MockRobot is not connected: use it as a context manager or call connect()")
        return {"state": self.state.copy()}

    def send_action(self, action: np.ndarray) -> np.ndarray:
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (self.dims,):
            raise ValueError(f"action must have shape ({self.dims},), got {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError("action contains NaN or inf")
        a = np.clip(a, -self.limit, self.limit)
        self.state = a.copy()
        self.sent.append(a)
        return a

    def safe_stop(self) -> None:
        self.stops += 1

    def disconnect(self) -> None:
        self.connected = False
