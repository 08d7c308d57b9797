# Build the Windows installer: PyInstaller one-folder bundle, self-test, Inno Setup.
#
#   powershell -ExecutionPolicy Bypass -File packaging\windows\build.ps1
#
# Needs Python 3.10+ (python.org, x64) and Inno Setup 6 (https://jrsoftware.org).
# Output: dist\cleave-app\ (the bundle) and dist\cleave-app-<version>-setup.exe.
# PyInstaller is not a cross-compiler: run this on Windows x64.
param(
    [string]$Python = "python",
    [string]$Iscc = "${env:ProgramFiles(x86)}\Inno Setup 6\ISCC.exe"
)
$ErrorActionPreference = "Stop"

function Invoke-Checked {
    # Native programs do not throw on failure; stop the build at the first one.
    param([string]$Exe, [string[]]$Arguments)
    & $Exe @Arguments
    if ($LASTEXITCODE -ne 0) { throw "$Exe $($Arguments -join ' ') failed with exit code $LASTEXITCODE" }
}

$Root = Resolve-Path "$PSScriptRoot\..\.."
Set-Location $Root
$Venv = "build\windows\venv"
$VenvPython = "$Venv\Scripts\python.exe"

# A venv of its own, so the bundle holds exactly what the app needs. PyPI's torch
# wheels for Windows are the CPU build.
if (-not (Test-Path $VenvPython)) { Invoke-Checked $Python @("-m", "venv", $Venv) }
Invoke-Checked $VenvPython @("-m", "pip", "install", "--quiet", "--upgrade", "pip")
Invoke-Checked $VenvPython @("-m", "pip", "install", "--quiet", "torch==2.13.0")
Invoke-Checked $VenvPython @("-m", "pip", "install", "--quiet", ".[package]")

$Version = & $VenvPython -c "import importlib.metadata as m; print(m.version('cleave'))"
if ($LASTEXITCODE -ne 0 -or -not $Version) { throw "cannot read the version of cleave" }
Write-Host "building Cleave $Version"

Invoke-Checked "$Venv\Scripts\pyinstaller.exe" @(
    "--noconfirm", "--distpath", "dist", "--workpath", "build\pyinstaller",
    "packaging\pyinstaller\cleave-app.spec"
)

# The windowed executable has no console to print to: judge it by its exit status.
$env:QT_QPA_PLATFORM = "offscreen"
$Check = Start-Process -FilePath "dist\cleave-app\cleave-app.exe" -ArgumentList "--self-test" -Wait -PassThru
Remove-Item Env:\QT_QPA_PLATFORM
if ($Check.ExitCode -ne 0) { throw "cleave-app --self-test failed (exit $($Check.ExitCode))" }
Write-Host "self-test passed"

# Inno Setup wants an .ico for the installer itself.
New-Item -ItemType Directory -Force -Path "build\windows" | Out-Null
Invoke-Checked $VenvPython @(
    "-c",
    "from PIL import Image; Image.open('packaging/icons/cleave-256.png').save('build/windows/cleave.ico', sizes=[(16,16),(32,32),(48,48),(64,64),(128,128),(256,256)])"
)

if (-not (Test-Path $Iscc)) { throw "Inno Setup's ISCC.exe not found at $Iscc (pass -Iscc PATH)" }
Invoke-Checked $Iscc @("/DAppVersion=$Version", "packaging\windows\cleave-app.iss")
Write-Host "built dist\cleave-app-$Version-setup.exe"
