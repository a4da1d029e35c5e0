from gpuopt_tui.cli import main

raise SystemExit(main())
