#pragma once /* tests/cuda_emu/emu.h provides what cuda_step.cu uses */
