// Written by the CPU attention work (issue 2).
#include "attention/backends.h"
