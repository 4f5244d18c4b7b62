from megatron_ppo.cli import main

raise SystemExit(main())
